"""Deployment: launch.py builds the actor graph from a ClusterConfig; *.yaml configs; grafana/ dashboards."""
