"""The engine's configs: ``ModelConfig`` (which checkpoint, how) and ``EngineConfig`` (one paged-KV
engine's scheduling and KV-cache settings, and the one derivation of the served length)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from cluster.config.checking import from_dict, require

DTYPES = ("auto", "float32", "float16", "bfloat16")
DEVICES = ("auto", "cpu", "cuda")
ATTENTION_BACKENDS = ("torch", "triton")
LOAD_FORMATS = ("auto", "dummy", "mock")

# NOTE: the structured-output caps' defaults: the engine checks them before compiling, and the HTTP edge
# refuses a spec over them before queueing (cluster/http/output_constraints.py), so a bomb reaches no queue.
MAX_STRUCTURED_SPEC_CHARS = 256 * 1024
MAX_GRAMMAR_RULES = 2000


@dataclass(frozen=True)
class ModelConfig:
    """Which checkpoint to serve and how.

    path: a Hugging Face checkpoint directory (config.json + *.safetensors [+ tokenizer.json]) or a
    Hugging Face repo id (``org/name``, resolved through the hub cache by ``cluster/hub.py`` before any
    worker starts); empty means the bundled tiny model. revision: the repo's branch, tag or commit
    (repo ids only). dtype "auto" takes the checkpoint's torch_dtype on CUDA and float32 on CPU.
    max_model_len None means the model's max_position_embeddings.
    """

    path: str = ""
    dtype: str = "auto"
    max_model_len: int | None = None
    revision: str | None = None

    def __post_init__(self) -> None:
        require(self.dtype in DTYPES, f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        require(
            self.max_model_len is None or self.max_model_len >= 1,
            f"max_model_len must be >= 1, got {self.max_model_len}",
        )


@dataclass(frozen=True)
class EngineConfig:
    """Scheduling and KV-cache settings of one paged-KV engine."""

    model: ModelConfig = field(default_factory=ModelConfig)
    device: str = "auto"
    block_size: int = 16
    # None: sized from memory (gpu_memory_utilization on CUDA, cpu_kv_cache_bytes on CPU).
    num_kv_blocks: int | None = None
    gpu_memory_utilization: float = 0.9
    cpu_kv_cache_bytes: int = 1 << 30
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    enable_prefix_caching: bool = True
    # Host-memory tier under the device prefix cache (workers/host_tier.py): blocks evicted from the
    # device cache are kept in this many GiB of (pinned, on CUDA) host memory per rank and loaded back on
    # a prefix hit; 0 turns it off (vLLM's kv_offloading_size, SGLang's hicache size).
    kv_offload_gib: float = 0.0
    attention_backend: str = "torch"
    # CUDA graphs for decode-only steps (CUDA + triton backend): batch sizes 1, 2, 4, 8, 16, ... up to
    # min(max_num_seqs, cuda_graph_max_batch_size); enforce_eager turns them off.
    enforce_eager: bool = False
    cuda_graph_max_batch_size: int = 256
    seed: int = 0
    # "auto": weights from the checkpoint's *.safetensors; "dummy": random weights built on the device
    # from config.json alone (benchmarks; vLLM's name for it); "mock": no weights and no forward: on the
    # host, each step waits the time mock_cost_profile predicts for it and samples a deterministic token
    # (workers/mock_runner.py).
    load_format: str = "auto"
    # load_format mock: the cost profile JSON whose step time a mock step waits (a path, or "default":
    # where `pdserve plan calibrate` writes it); "": steps wait nothing
    mock_cost_profile: str = ""
    # Schedule and prepare step N+1 while step N runs on the device (outputs are the same either way).
    # None: on for CUDA, off on CPU (there the host is the device: nothing to overlap).
    async_scheduling: bool | None = None
    # CPU device: glibc keeps freed memory for the next step's activations instead of returning it to
    # the kernel and faulting it back in (workers/host_memory.py; process-wide, set when the engine starts).
    retain_host_memory: bool = True
    # Structured outputs (workers/structured_compile.py): grammars compile on this many helper threads,
    # never on the step thread; a compile over the timeout fails its requests (400
    # structured_output_too_complex); a spec over the character or rule cap fails before compiling;
    # at most max_pending_compiles distinct specs are queued or compiling (over it: 429).
    structured_compile_threads: int = 2
    structured_compile_timeout_s: float = 5.0
    structured_max_pending_compiles: int = 64
    structured_max_spec_chars: int = MAX_STRUCTURED_SPEC_CHARS
    structured_max_grammar_rules: int = MAX_GRAMMAR_RULES
    # Ranks of one worker (Megatron-style tensor parallelism, workers/models/parallel.py): the model's heads,
    # MLP width and vocabulary split over this many processes on one node, one device each; set per pool
    # by PoolConfig.tensor_parallel_size (vLLM's --tensor-parallel-size).
    tensor_parallel_size: int = 1

    def __post_init__(self) -> None:
        require(self.device in DEVICES, f"device must be one of {DEVICES}, got {self.device!r}")
        require(
            self.structured_compile_threads >= 1,
            f"structured_compile_threads must be >= 1, got {self.structured_compile_threads}",
        )
        require(
            self.structured_compile_timeout_s > 0,
            f"structured_compile_timeout_s must be > 0, got {self.structured_compile_timeout_s}",
        )
        require(
            min(
                self.structured_max_pending_compiles,
                self.structured_max_spec_chars,
                self.structured_max_grammar_rules,
            )
            >= 1,
            "structured_max_pending_compiles, structured_max_spec_chars and structured_max_grammar_rules "
            "must be >= 1",
        )
        require(
            1 <= self.tensor_parallel_size <= 64,
            f"tensor_parallel_size must be in [1, 64], got {self.tensor_parallel_size}",
        )
        require(
            0.0 <= self.kv_offload_gib <= 4096.0,
            f"kv_offload_gib must be in [0, 4096], got {self.kv_offload_gib}",
        )
        require(
            self.kv_offload_gib == 0.0 or self.enable_prefix_caching,
            "kv_offload_gib needs enable_prefix_caching (the host tier holds prefix-cache blocks)",
        )
        require(1 <= self.block_size <= 1024, f"block_size must be in [1, 1024], got {self.block_size}")
        require(
            self.num_kv_blocks is None or self.num_kv_blocks >= 2,
            f"num_kv_blocks must be >= 2 (block 0 is reserved), got {self.num_kv_blocks}",
        )
        require(
            0.0 < self.gpu_memory_utilization <= 1.0,
            f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}",
        )
        require(self.max_num_seqs >= 1, f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        require(
            self.max_num_batched_tokens >= 1,
            f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}",
        )
        require(
            self.attention_backend in ATTENTION_BACKENDS,
            f"attention_backend must be one of {ATTENTION_BACKENDS}, got {self.attention_backend!r}",
        )
        require(
            self.cuda_graph_max_batch_size >= 1,
            f"cuda_graph_max_batch_size must be >= 1, got {self.cuda_graph_max_batch_size}",
        )
        require(
            self.load_format in LOAD_FORMATS,
            f"load_format must be one of {LOAD_FORMATS}, got {self.load_format!r}",
        )
        require(
            self.load_format != "mock" or self.device != "cuda",
            "load_format mock runs on the host: device must be auto or cpu, got 'cuda'",
        )
        require(
            not self.mock_cost_profile or self.load_format == "mock",
            f"mock_cost_profile is read by load_format mock only, got load_format {self.load_format!r}",
        )

    def uses_async_scheduling(self, device_type: str) -> bool:
        """``async_scheduling`` as set, or (unset) whether the engine runs on CUDA."""
        return device_type == "cuda" if self.async_scheduling is None else self.async_scheduling

    def max_model_len(self, max_position_embeddings: int, num_kv_blocks: int | None = None) -> int:
        """The longest sequence (prompt + output) an engine of this config serves: ``model.max_model_len``
        (None: the checkpoint's ``max_position_embeddings``), capped by what ``num_kv_blocks`` hold when
        given. The one place this is derived (the model runner, hence the engine, and ``pdserve plan``)."""
        limit = self.model.max_model_len or max_position_embeddings
        if num_kv_blocks is None:
            return limit
        # NOTE: a sequence can never outgrow the KV pool (block 0 is reserved), so the pool caps it too.
        return min(limit, (num_kv_blocks - 1) * self.block_size)

    @classmethod
    def from_options(cls, model: str = "", **options: Any) -> EngineConfig:
        """Build from flat keyword options (the offline API's `LLM(model, **options)`)."""
        model_keys = {f.name for f in dataclasses.fields(ModelConfig)} - {"path"}
        model_opts = {k: options.pop(k) for k in list(options) if k in model_keys}
        return from_dict(cls, {**options, "model": {"path": model, **model_opts}})
