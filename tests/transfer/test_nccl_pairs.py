"""The nccl pair path on CPU, with torch.distributed's NCCL pieces and the CUDA calls faked: the device a
pair's group gets always has an index, the NCCL watchdog is told not to take the process down (before
the first ProcessGroupNCCL), and the warm-up never blocks the default stream or the whole device.

What only a GPU shows (that NCCL accepts the indexed device, that a stuck op is aborted without the
process dying, that the warm-up does not wait behind a forward) is checked by the gpu-marked tests and
bench/bench_transfer.py on a GPU box.
"""

from __future__ import annotations

import os
import threading
from typing import Any

import pytest
import torch
import torch.distributed as dist

import transfer.pairs as pairs
from transfer.pairs import NCCL_ENV_DEFAULTS, PairChannel, build_group, indexed_device
from transfer.peers import DECODE_RANK, PREFILL_RANK, PairKey, PeerId
from transfer.protocol import TransferPairError
from transfer.rendezvous import RendezvousLink

KEY = PairKey(PeerId("prefill-0", "p0"), PeerId("decode-0", "d0"), 3)
NCCL_ENV_NAMES = [name for names in NCCL_ENV_DEFAULTS for name in names]


class FakeNCCL:
    """Stands in for dist.ProcessGroupNCCL: records the env it was built under."""

    built: list[dict[str, str | None]]

    class Options:
        _timeout: Any = None

    def __init__(self, store: Any, rank: int, size: int, options: Any) -> None:
        type(self).built.append({name: os.environ.get(name) for name in NCCL_ENV_NAMES})


@pytest.fixture
def fake_dist(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """Fake store, NCCL group and set_device; returns the devices set_device was called with."""
    set_devices: list[Any] = []
    FakeNCCL.built = []
    monkeypatch.setattr(dist, "TCPStore", lambda *args: "client")
    monkeypatch.setattr(dist, "PrefixStore", lambda prefix, client: (prefix, client))
    monkeypatch.setattr(dist, "ProcessGroupNCCL", FakeNCCL, raising=False)
    monkeypatch.setattr(torch.cuda, "set_device", set_devices.append)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    for name in NCCL_ENV_NAMES:
        monkeypatch.delenv(name, raising=False)
    return set_devices


def linked(channel: PairChannel, rank: int) -> PairChannel:
    """`channel` with a rendezvous link for KEY's end at `rank` (as a KVSender / KVReceiver attaches)."""
    channel.use_link(RendezvousLink(KEY.ends[rank], rank, lambda: None))
    return channel


def test_a_bare_cuda_device_gets_the_current_index(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert indexed_device(torch.device("cuda")) == torch.device("cuda", 3)
    assert indexed_device(torch.device("cuda", 1)) == torch.device("cuda", 1)
    assert indexed_device(torch.device("cpu")) == torch.device("cpu")


def test_build_group_sets_an_indexed_device(fake_dist: list[Any]) -> None:
    build_group(("127.0.0.1", 1), "p/", 0, "nccl", "127.0.0.1", 5.0, torch.device("cuda"))
    build_group(("127.0.0.1", 1), "p/", 0, "nccl", "127.0.0.1", 5.0, torch.device("cuda", 1))
    assert fake_dist == [torch.device("cuda", 3), torch.device("cuda", 1)]
    assert all(d.index is not None for d in fake_dist)


def test_the_pair_channel_resolves_its_device_on_the_owners_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    """The current device is per thread: the build thread's would be cuda:0 whatever the owner's is."""
    owner = threading.get_ident()
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 2 if threading.get_ident() == owner else 0)
    built_on: list[torch.device] = []

    def fake_build_group(*args: Any) -> Any:
        built_on.append(args[-1])
        raise RuntimeError("no NCCL here")

    monkeypatch.setattr(pairs, "build_group", fake_build_group)
    channel = linked(PairChannel("127.0.0.1", "nccl", device=torch.device("cuda")), PREFILL_RANK)
    with pytest.raises(TransferPairError, match="no NCCL here"):
        channel.connect(KEY, PREFILL_RANK).wait(10.0)
    assert built_on == [torch.device("cuda", 2)]


def test_an_nccl_group_is_built_after_the_watchdog_is_told_to_keep_the_process(fake_dist: list[Any]) -> None:
    build_group(("127.0.0.1", 1), "p/", 0, "nccl", "127.0.0.1", 5.0, torch.device("cuda", 0))
    assert FakeNCCL.built == [
        {
            "TORCH_NCCL_ASYNC_ERROR_HANDLING": "2",  # CleanUpOnly: abort the communicator, keep the process
            "NCCL_ASYNC_ERROR_HANDLING": None,
            "TORCH_NCCL_ENABLE_MONITORING": "0",
        }
    ]


@pytest.mark.parametrize(
    "user",
    [
        {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1", "TORCH_NCCL_ENABLE_MONITORING": "1"},
        {"NCCL_ASYNC_ERROR_HANDLING": "3"},  # the legacy name counts as the user's choice too
    ],
)
def test_the_users_own_nccl_env_is_kept(
    fake_dist: list[Any], monkeypatch: pytest.MonkeyPatch, user: dict[str, str]
) -> None:
    for name, value in user.items():
        monkeypatch.setenv(name, value)
    build_group(("127.0.0.1", 1), "p/", 0, "nccl", "127.0.0.1", 5.0, torch.device("cuda", 0))
    expected = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": None, "NCCL_ASYNC_ERROR_HANDLING": None}
    expected["TORCH_NCCL_ENABLE_MONITORING"] = "0"
    assert FakeNCCL.built == [{**expected, **user}]


class FakeWork:
    """An nccl Work that completes after `num_polls` polls of is_completed (never, if None); then the
    recv's probe holds `carried`. Records whether each wait() came after completion."""

    def __init__(self, probe: torch.Tensor, num_polls: int | None, carried: int | None) -> None:
        self.probe, self.num_polls, self.carried = probe, num_polls, carried
        self.polls = 0
        self.waits: list[bool] = []

    def is_completed(self) -> bool:
        self.polls += 1
        done = self.num_polls is not None and self.polls >= self.num_polls
        if done and self.carried is not None:
            self.probe.fill_(self.carried)
        return done

    def wait(self) -> bool:
        is_done = self.num_polls is not None and self.polls >= self.num_polls
        self.waits.append(is_done)
        if not is_done:  # NOTE: stands for a wait that would stall the caller's stream on the peer
            raise RuntimeError("wait() before completion")
        return True


class FakeGroup:
    def __init__(self, num_polls: int | None, carried: int | None) -> None:
        self.num_polls, self.carried = num_polls, carried
        self.works: list[FakeWork] = []

    def _work(self, tensors: list[torch.Tensor], carried: int | None) -> FakeWork:
        self.works.append(FakeWork(tensors[0], self.num_polls, carried))
        return self.works[-1]

    def send(self, tensors: list[torch.Tensor], peer: int, tag: int) -> FakeWork:
        return self._work(tensors, None)

    def recv(self, tensors: list[torch.Tensor], peer: int, tag: int) -> FakeWork:
        return self._work(tensors, self.carried)


def _nccl_channel(monkeypatch: pytest.MonkeyPatch, group: FakeGroup, timeout_s: float) -> list[Any]:
    """A PairChannel(nccl) on CPU whose groups are `group`; returns the torch.cuda.synchronize calls."""
    synced: list[Any] = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *args: synced.append(args))
    monkeypatch.setattr(pairs, "build_group", lambda *args: group)
    return synced


@pytest.mark.parametrize("rank", [PREFILL_RANK, DECODE_RANK])
def test_the_nccl_warm_up_polls_and_never_blocks_a_stream_or_the_device(
    monkeypatch: pytest.MonkeyPatch, rank: int
) -> None:
    group = FakeGroup(num_polls=3, carried=KEY.generation)
    synced = _nccl_channel(monkeypatch, group, 5.0)
    channel = linked(PairChannel("127.0.0.1", "nccl", group_timeout_s=5.0, device=torch.device("cpu")), rank)
    channel.connect(KEY, rank).wait(10.0)
    [work] = group.works
    assert (work.polls, work.waits) == (3, [True])  # wait() only once the op completed
    assert synced == []
    assert channel.broken_pairs() == []


def test_a_stuck_nccl_warm_up_breaks_the_pair_at_the_group_timeout(monkeypatch: pytest.MonkeyPatch) -> None:
    group = FakeGroup(num_polls=None, carried=None)
    synced = _nccl_channel(monkeypatch, group, 0.2)
    channel = linked(
        PairChannel("127.0.0.1", "nccl", group_timeout_s=0.2, device=torch.device("cpu")), DECODE_RANK
    )
    with pytest.raises(TransferPairError, match=r"warm-up with prefill-0/p0 did not complete within 0\.200s"):
        channel.connect(KEY, DECODE_RANK).wait(10.0)
    [work] = group.works
    assert work.waits == [] and work.polls > 1
    assert synced == []
    assert channel.broken_pairs() == [KEY]
    assert channel.generation(KEY.prefill, KEY.decode) == KEY.generation + 1


def test_a_wrong_warm_up_value_breaks_the_pair(monkeypatch: pytest.MonkeyPatch) -> None:
    group = FakeGroup(num_polls=1, carried=KEY.generation + 5)
    _nccl_channel(monkeypatch, group, 5.0)
    channel = linked(
        PairChannel("127.0.0.1", "nccl", group_timeout_s=5.0, device=torch.device("cpu")), DECODE_RANK
    )
    with pytest.raises(TransferPairError, match="warm-up carried 8, not 3"):
        channel.connect(KEY, DECODE_RANK).wait(10.0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_real_nccl_group_takes_a_bare_cuda_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """ProcessGroupNCCL is made lazily (no peer needed): set_device gets an index and the env is set."""
    for name in NCCL_ENV_NAMES:
        monkeypatch.delenv(name, raising=False)
    server = dist.TCPStore("127.0.0.1", 0, 2, True, wait_for_workers=False)
    group = build_group(
        ("127.0.0.1", server.port), "gpu/", 0, "nccl", "127.0.0.1", 10.0, torch.device("cuda")
    )
    assert group.rank() == 0 and group.size() == 2
    assert os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "2"
    assert os.environ["TORCH_NCCL_ENABLE_MONITORING"] == "0"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_nccl_warm_up_does_not_wait_for_the_engines_stream(monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine's forward stands as a long kernel on the default stream: the pair is built (probe
    filled, polled, read) while that kernel still runs."""
    group = FakeGroup(num_polls=2, carried=KEY.generation)
    synced = _nccl_channel(monkeypatch, group, 30.0)
    channel = linked(
        PairChannel("127.0.0.1", "nccl", group_timeout_s=30.0, device=torch.device("cuda")), DECODE_RANK
    )
    torch.cuda.current_stream().synchronize()
    torch.cuda._sleep(4_000_000_000)  # NOTE: ~2 s of GPU clock cycles, queued on the default stream
    forward_done = torch.cuda.Event()
    forward_done.record()
    channel.connect(KEY, DECODE_RANK).wait(30.0)
    assert not forward_done.query()  # built while the "forward" still ran
    forward_done.synchronize()
    assert synced == [] and channel.broken_pairs() == []
