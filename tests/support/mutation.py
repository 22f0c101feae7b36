"""Mutation testing of the engine core: small deliberate bugs, one at a time, each run against the tests
that cover its module. A mutant the tests still pass is a survivor: a bug class nothing catches.

    python -m tests.support.mutation                      # every module in TARGETS (`make mutation`)
    python -m tests.support.mutation workers/scheduler.py --list      # print the mutants, run nothing
    python -m tests.support.mutation --json out.json --jobs 2
    python -m tests.support.mutation transfer/receiver.py --sample 70 --seed 0   # a seeded sample per module
    python -m tests.support.mutation transfer/receiver.py --sample 70 --seed 0 --complement   # the rest of it

Every mutant runs in a throwaway copy of the tree (tracked + untracked-not-ignored files), never in the
working tree. Stages run in order with ``-x``: a mutant is killed by the first stage that fails (or
times out twice, the second time with a 3x longer bound); the slower engine stage only runs for
mutants the fast unit stage let through. Survivors are printed for a human to kill with a test or to
argue equivalent (``# pragma: no mutate`` on a line skips it).
"""

from __future__ import annotations

import argparse
import ast
import concurrent.futures
import copy
import dataclasses
import json
import os
import pathlib
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence

REPO = pathlib.Path(__file__).resolve().parents[2]

# A stage is pytest arguments (a -k applies to the whole stage). Torch-free unit tests (about a second a
# run), then engine-level tests against transformers on one architecture (scheduling and block bugs do
# not depend on it; the full suite covers all four), then the handoff roles driven turn by turn (a real
# engine, a fake KV mover), early decode admission against a real KV sender, then a whole cluster in
# this process (router + workers, real KV transfers, no Ray), then the KV transfer between real
# processes, and the router against fake workers.
UNIT_STAGE = (
    "tests/workers/test_block_manager.py",
    "tests/workers/test_scheduler.py",
    "tests/workers/test_scheduler_steps.py",
    "tests/workers/test_prefix_cache.py",
)
ENGINE_STAGE = (
    "tests/workers/test_engine_scheduling.py",
    "tests/workers/test_engine_hf.py",
    "-k",
    "scheduling or qwen3",
)
HANDOFF_STAGE = (
    "tests/workers/test_decode_handoff.py",
    "tests/workers/test_prefill_role.py",
    "tests/workers/test_worker_roles.py",
)
EARLY_STAGE = ("tests/e2e/test_early_admission.py",)  # the decode role's early admission, with a real sender
CLUSTER_STAGE = ("tests/e2e/test_local_cluster.py",)
RECEIVER_STAGE = ("tests/transfer/test_receiver_unit.py", "tests/e2e/test_local_cluster.py")
TRANSFER_STAGE = ("tests/transfer/test_transfer.py",)
ROUTER_STAGE = (
    "tests/cluster/test_router_unit.py",
    "tests/cluster/test_router_migration.py",
    "tests/cluster/test_router_lifecycle.py",
)
CORE_STAGES = (UNIT_STAGE, ENGINE_STAGE, HANDOFF_STAGE)
ROLE_STAGES = (HANDOFF_STAGE, EARLY_STAGE, CLUSTER_STAGE)

# module -> its test stages. Adding a module is one line. A whole run (`make mutation`) takes hours on a
# 2-core box (the transfer receiver's mutants the most); name modules to run a subset.
TARGETS: dict[str, tuple[tuple[str, ...], ...]] = {
    "workers/scheduler.py": CORE_STAGES,
    "workers/block_manager.py": CORE_STAGES,
    "workers/prefix_cache.py": CORE_STAGES,
    "workers/decode_role.py": ROLE_STAGES,
    "workers/prefill_role.py": ROLE_STAGES,
    "transfer/receiver.py": (RECEIVER_STAGE, TRANSFER_STAGE),
    "cluster/router/router.py": (ROUTER_STAGE,),
    "cluster/router/membership.py": (ROUTER_STAGE,),
    "cluster/router/flights.py": (ROUTER_STAGE,),
    "cluster/router/stream.py": (ROUTER_STAGE,),
    "cluster/router/events.py": (ROUTER_STAGE,),
    "cluster/router/handoff.py": (ROUTER_STAGE,),
}

# NOTE: a fixed order; no cache files in the tree; hypothesis's plugin is a second of imports per run
# and no stage uses it.
PYTEST_PLUGINS_OFF = ("-p", "no:randomly", "-p", "no:cacheprovider", "-p", "no:hypothesispytest")
# NOTE: a mutant that hangs a test (e.g. a worker half built, its sockets never closed) fails that test
# after this long instead of holding the stage until its bound, twice; every unmutated test of a stage
# takes well under it even on a loaded box (the baseline check runs with it too).
PER_TEST_TIMEOUT = ("-o", "timeout=180")
# tests/support/oracle_cache.py keeps the random checkpoint and transformers' outputs here for the whole run
CACHE_ENV = "PDSERVE_TEST_CACHE"

SKIP_MARK = "pragma: no mutate"
_COMPARE_SWAPS: dict[type, type] = {
    ast.Lt: ast.LtE, ast.LtE: ast.Lt, ast.Gt: ast.GtE, ast.GtE: ast.Gt, ast.Eq: ast.NotEq,
    ast.NotEq: ast.Eq, ast.Is: ast.IsNot, ast.IsNot: ast.Is, ast.In: ast.NotIn, ast.NotIn: ast.In,
}  # fmt: skip
_BINOP_SWAPS: dict[type, type] = {
    ast.Add: ast.Sub, ast.Sub: ast.Add, ast.Mult: ast.FloorDiv, ast.FloorDiv: ast.Mult, ast.Mod: ast.FloorDiv,
}  # fmt: skip
_DELETABLE = (ast.Expr, ast.Assign, ast.AugAssign, ast.Return, ast.Raise, ast.Continue, ast.Break)


@dataclasses.dataclass(frozen=True)
class Mutant:
    module: str
    line: int
    description: str
    source: str  # the whole mutated module

    @property
    def name(self) -> str:
        return f"{self.module}:{self.line}: {self.description}"


@dataclasses.dataclass
class Outcome:
    mutant: Mutant
    status: str  # "killed", "timeout" (counted as killed), "survived"
    stage: int | None  # index of the stage that killed it
    seconds: float


def _skipped_nodes(tree: ast.Module) -> set[int]:
    """ids of nodes never mutated: docstrings, annotations, decorators, imports."""
    skip: set[int] = set()

    def mark(node: ast.AST | None) -> None:
        if node is not None:
            skip.update(id(n) for n in ast.walk(node))

    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        first = body[0] if isinstance(body, list) and body else None
        if isinstance(first, ast.Expr) and isinstance(getattr(first.value, "value", None), str):
            mark(first)
        if isinstance(node, ast.arg | ast.AnnAssign):
            mark(node.annotation)
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            mark(node.returns)
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            for d in node.decorator_list:
                mark(d)
        if isinstance(node, ast.Import | ast.ImportFrom | ast.JoinedStr):
            mark(node)
    return skip


def _variants(node: ast.AST, is_bare_condition: bool) -> Iterator[tuple[ast.AST, str]]:
    """(replacement node, description) for each mutation of ``node`` alone. ``is_bare_condition``: the
    test of an if/while/ternary that no compare, boolean or ``not`` mutation reaches (``if hit_ids:``)."""
    if is_bare_condition:
        yield ast.UnaryOp(ast.Not(), copy.deepcopy(node)), "negate condition"
    if isinstance(node, ast.Compare):
        for i, op in enumerate(node.ops):
            swap = _COMPARE_SWAPS.get(type(op))
            if swap is not None:
                new = copy.deepcopy(node)
                new.ops[i] = swap()
                yield new, "compare"
    elif isinstance(node, ast.BinOp) and type(node.op) in _BINOP_SWAPS:
        new = copy.deepcopy(node)
        new.op = _BINOP_SWAPS[type(node.op)]()
        yield new, "operator"
    elif isinstance(node, ast.AugAssign) and isinstance(node.op, ast.Add | ast.Sub):
        new = copy.deepcopy(node)
        new.op = ast.Sub() if isinstance(node.op, ast.Add) else ast.Add()
        yield new, "augassign"
    elif isinstance(node, ast.BoolOp):
        new = copy.deepcopy(node)
        new.op = ast.Or() if isinstance(node.op, ast.And) else ast.And()
        yield new, "boolop"
    elif isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not | ast.USub):
        yield copy.deepcopy(node.operand), "drop unary"
    elif isinstance(node, ast.Constant) and type(node.value) in (bool, int):
        if isinstance(node.value, bool):
            yield ast.Constant(not node.value), "constant"
        else:
            yield ast.Constant(node.value + 1), "constant"
            if node.value == 1:
                yield ast.Constant(0), "constant"
    elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("min", "max"):
        new = copy.deepcopy(node)
        new.func = ast.Name("max" if node.func.id == "min" else "min", ast.Load())
        yield new, "min/max"
    if isinstance(node, _DELETABLE):
        yield ast.Pass(), "delete statement"
    if isinstance(node, ast.Break | ast.Continue):
        yield (ast.Continue() if isinstance(node, ast.Break) else ast.Break()), "break/continue"


def _line_offsets(text: str) -> list[int]:
    offsets = [0]
    for line in text.splitlines(keepends=True):
        offsets.append(offsets[-1] + len(line.encode()))
    return offsets


def generate_mutants(module: str, root: pathlib.Path = REPO) -> list[Mutant]:
    """Every single-point mutant of ``module`` that still parses and differs from the original."""
    text = (root / module).read_text()
    data = text.encode()
    lines = text.splitlines()
    offsets = _line_offsets(text)
    tree = ast.parse(text)
    original = ast.dump(tree)
    skip = _skipped_nodes(tree)
    bare_conditions = {
        id(n.test)
        for n in ast.walk(tree)
        if isinstance(n, ast.If | ast.While | ast.IfExp)
        and not isinstance(n.test, ast.Compare | ast.BoolOp | ast.UnaryOp | ast.Constant)
    }
    mutants: list[Mutant] = []
    for node in ast.walk(tree):
        if id(node) in skip or not hasattr(node, "lineno") or node.end_lineno is None:
            continue
        if SKIP_MARK in lines[node.lineno - 1]:
            continue
        start = offsets[node.lineno - 1] + node.col_offset
        end = offsets[node.end_lineno - 1] + (node.end_col_offset or 0)
        before = data[start:end].decode()
        for replacement, kind in _variants(node, id(node) in bare_conditions):
            after = ast.unparse(replacement)
            # NOTE: a multi-line statement collapses onto one line; wrap expressions to keep precedence
            if not isinstance(node, ast.stmt):
                after = f"({after})"
            source = (data[:start] + after.encode() + data[end:]).decode()
            try:
                if ast.dump(ast.parse(source)) == original:
                    continue
            except SyntaxError:
                continue
            first = before.splitlines()[0] if before else ""
            short = first if len(first) <= 60 else first[:57] + "..."
            label = after if len(after) <= 60 else after[:57] + "..."
            mutants.append(Mutant(module, node.lineno, f"{kind}: `{short}` -> `{label}`", source))
    mutants.sort(key=lambda m: m.line)
    return mutants


def copy_tree(dest: pathlib.Path) -> None:
    """Copy the tracked and untracked-not-ignored files of the repository into ``dest``."""
    names = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=REPO, check=True, capture_output=True,
    ).stdout.decode().split("\0")  # fmt: skip
    for name in filter(None, names):
        src = REPO / name
        if src.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name)


def run_stage(tree: pathlib.Path, stage: Sequence[str], timeout_s: float) -> str:
    """ "pass", "fail" or "timeout" for one stage's tests in ``tree``."""
    cmd = [sys.executable, "-m", "pytest", "-x", "-q", *PYTEST_PLUGINS_OFF, *PER_TEST_TIMEOUT, *stage]
    # NOTE: no bytecode: a mutant of the same size written within the same second would otherwise load
    # the original's cached .pyc.
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    try:
        proc = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, timeout=timeout_s)
    except subprocess.TimeoutExpired as e:
        # NOTE: a test that failed and then held the process (e.g. a half-built worker's ZMQ context
        # blocking in the garbage collector) is a kill, not a slow box: no retry for it.
        return "fail" if _reported_a_failure((e.stdout or b"").decode(errors="replace")) else "timeout"
    # NOTE: usage error or nothing collected is the runner's fault; an internal error is not (a mutant can
    # crash pytest itself, e.g. while it renders the mutant's failure), and the baseline ran clean.
    if proc.returncode in (4, 5):
        raise RuntimeError(f"pytest {stage} exited {proc.returncode}:\n{proc.stdout.decode()[-2000:]}")
    return "pass" if proc.returncode == 0 else "fail"


def _reported_a_failure(output: str) -> bool:
    """pytest -q's progress line (unbuffered) shows a failed or erroring test."""
    return re.search(r"^[.sxX]*[FE][.FEsxX]*\s*(\[\s*\d+%\])?\s*$", output, re.MULTILINE) is not None


def check_baseline(tree: pathlib.Path, stages: Sequence[Sequence[str]]) -> list[float]:
    """Every stage must pass unmutated; returns each stage's timeout (generous: the box may be busy)."""
    timeouts = []
    for stage in stages:
        t0 = time.monotonic()
        if run_stage(tree, stage, 1800) != "pass":
            raise RuntimeError(f"the unmutated tree fails {list(stage)}; fix that first")
        timeouts.append(max(120.0, 10 * (time.monotonic() - t0)))
    return timeouts


def run_mutant(
    tree: pathlib.Path, mutant: Mutant, stages: Sequence[Sequence[str]], timeouts: list[float]
) -> Outcome:
    path = tree / mutant.module
    original = path.read_text()
    t0 = time.monotonic()
    try:
        path.write_text(mutant.source)
        for i, (stage, timeout_s) in enumerate(zip(stages, timeouts, strict=True)):
            result = run_stage(tree, stage, timeout_s)
            if result == "timeout":  # NOTE: a busy machine can slow a sound run past the bound: retry, longer
                result = run_stage(tree, stage, 3 * timeout_s)
            if result != "pass":
                status = "timeout" if result == "timeout" else "killed"
                return Outcome(mutant, status, i, time.monotonic() - t0)
        return Outcome(mutant, "survived", None, time.monotonic() - t0)
    finally:
        path.write_text(original)


def sample_per_module(mutants: Sequence[Mutant], n: int, seed: int) -> list[Mutant]:
    """A seeded sample of ``n`` mutants of each module (all of a module with fewer), in source order."""
    rng = random.Random(seed)
    by_module: dict[str, list[int]] = {}
    for i, m in enumerate(mutants):
        by_module.setdefault(m.module, []).append(i)
    keep = {i for idx in by_module.values() for i in (idx if len(idx) <= n else rng.sample(idx, n))}
    return [m for i, m in enumerate(mutants) if i in keep]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("modules", nargs="*", help=f"subset of {sorted(TARGETS)}")
    parser.add_argument("--list", action="store_true", help="print the mutants and exit")
    parser.add_argument("--jobs", type=int, default=1, help="mutants run at once (one tree copy each)")
    parser.add_argument("--json", type=pathlib.Path, help="write every outcome here")
    parser.add_argument("--max-stages", type=int, help="run only the first N test stages (quick look)")
    parser.add_argument(
        "--match", action="append", help="only mutants whose name contains this (e.g. 'py:119:'); repeatable"
    )
    parser.add_argument(
        "--sample",
        type=int,
        help="run a seeded random sample of this many mutants per module (an estimate of the score when "
        "the whole run does not fit the time at hand)",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of --sample")
    parser.add_argument(
        "--complement",
        action="store_true",
        help="with --sample: run the mutants that sample leaves out (the rest of a sampled run; the same "
        "modules in the same order, at a tree whose mutants did not change)",
    )
    args = parser.parse_args(argv)
    if args.complement and args.sample is None:
        parser.error("--complement needs --sample")
    unknown = sorted(set(args.modules) - set(TARGETS))
    if unknown:
        parser.error(f"unknown module(s) {unknown}; known: {sorted(TARGETS)}")
    modules = args.modules or list(TARGETS)
    stages = {m: TARGETS[m][: args.max_stages] for m in modules}
    mutants = [
        m
        for module in modules
        for m in generate_mutants(module)
        if not args.match or any(text in m.name for text in args.match)
    ]
    if args.sample is not None:
        sampled = sample_per_module(mutants, args.sample, args.seed)
        if args.complement:
            taken = {id(m) for m in sampled}
            mutants = [m for m in mutants if id(m) not in taken]
        else:
            mutants = sampled
    if args.list:
        for m in mutants:
            print(m.name)
        print(f"{len(mutants)} mutants")
        return 0

    # NOTE: SIGTERM unwinds like Ctrl-C, so the throwaway trees are removed
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    with tempfile.TemporaryDirectory(prefix="pdserve-mutation-") as tmp:
        cache = pathlib.Path(tmp) / "cache"
        cache.mkdir()
        os.environ[CACHE_ENV] = str(cache)
        trees = [pathlib.Path(tmp) / f"tree{i}" for i in range(max(1, args.jobs))]
        for tree in trees:
            copy_tree(tree)
        by_stages = {st: check_baseline(trees[0], st) for st in dict.fromkeys(stages.values())}
        timeouts = {m: by_stages[stages[m]] for m in modules}
        print(f"{len(mutants)} mutants in {modules}; stage timeouts {timeouts}", flush=True)
        free = list(trees)
        outcomes: list[Outcome] = []

        def work(m: Mutant) -> Outcome:
            tree = free.pop()
            try:
                return run_mutant(tree, m, stages[m.module], timeouts[m.module])
            finally:
                free.append(tree)

        with concurrent.futures.ThreadPoolExecutor(len(trees)) as pool:
            for n, outcome in enumerate(pool.map(work, mutants), 1):
                outcomes.append(outcome)
                stage = "" if outcome.stage is None else f" (stage {outcome.stage})"
                print(
                    f"[{n}/{len(mutants)}] {outcome.status}{stage} {outcome.seconds:.1f}s {outcome.mutant.name}",
                    flush=True,
                )
    report(outcomes, modules)
    if args.json:
        rows = [
            {**dataclasses.asdict(o), "mutant": {**dataclasses.asdict(o.mutant), "source": None}}
            for o in outcomes
        ]
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


def report(outcomes: Sequence[Outcome], modules: Sequence[str]) -> None:
    print("\nmutation score (killed / total):")
    for module in modules:
        mine = [o for o in outcomes if o.mutant.module == module]
        killed = sum(o.status != "survived" for o in mine)
        print(f"  {module}: {killed}/{len(mine)}")
    killed = sum(o.status != "survived" for o in outcomes)
    print(f"  total: {killed}/{len(outcomes)}")
    survivors = [o for o in outcomes if o.status == "survived"]
    if survivors:
        print("survivors:")
        for o in survivors:
            print(f"  {o.mutant.name}")


if __name__ == "__main__":
    sys.exit(main())
