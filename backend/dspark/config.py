"""EngineConfig: every engine knob, in one place, mirrored by the `parameters` of config.pbtxt."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, get_type_hints

REPO_ROOT = Path(__file__).resolve().parents[2]
# The embedded default: SmolLM2-135M-Instruct converted from its GGUF by set-up, and its DSpark
# drafter, trained on an H200 by training/run_h200.sh and kept in the repository.
DEFAULT_TARGET_DIR = REPO_ROOT / "models" / "SmolLM2-135M-Instruct"
DEFAULT_DRAFT_DIR = REPO_ROOT / "drafters" / "SmolLM2-135M-Instruct-dspark"

SPEC_MODES = ("off", "static", "compact", "cap-accept")
PLANNER_POLICIES = ("sync", "lagged")
# The sps_table value that measures the table when the engine starts.
SPS_PROFILE = "profile"
DTYPES = ("auto", "float32", "bfloat16", "float16")
# `decode_burst` 0 (auto) on a GPU: steps a decode burst runs at most.
GPU_DECODE_BURST = 4


@dataclass
class EngineConfig:
    """Engine settings. Field names equal the config.pbtxt parameter keys.

    Configured values are kept verbatim; values derived from the checkpoints (block size
    when unset, context length) live in `ResolvedLimits`, computed by the engine.
    """

    # Hugging Face directory of the target model; empty: the embedded default (SmolLM2-135M-Instruct).
    model: str = ""
    # DSpark (or DFlash) draft checkpoint directory; empty: the embedded default's drafter.
    # Not loaded when spec_mode is "off".
    draft_model: str = ""
    # Weights and activations dtype: auto (bfloat16 on CUDA, float32 on CPU), float32, bfloat16, float16.
    dtype: str = "auto"
    # Where the engine runs: auto (cuda when available), cpu, cuda.
    device: str = "auto"
    # Speculation: off (plain decoding), static (verify all drafts), compact (ragged windows planned
    # from the drafts' confidences against sps_table; under the flat table, the default, it verifies
    # every draft, drafted inside the target step as static's are), cap-accept (verify all, commit only
    # up to the plan; a diagnostic). static is the default: on a GPU its drafts go into the verify
    # windows without a host round trip, and it measured fastest with the shipped drafter on an H200;
    # compact pays where a verify window's cost grows with its length.
    spec_mode: str = "static"
    # Verify-length planner: sync (early stop on this step's confidences) or lagged (top-K, K from an
    # earlier step's confidences).
    planner_policy: str = "sync"
    # Steps between the confidences that fix K and their use, for the lagged policy (>= 1).
    planner_lag: int = 1
    # The block size: positions a draft block drafts, and the most drafts a request verifies per step; at
    # most the drafter's trained block_size, 0 takes it. A shorter block drafts and verifies less (for a
    # small target whose drafts rarely survive past the first few).
    block_size: int = 0
    # Draft from the K most frequent tokens only, as ordered by the drafter's draft_vocab.safetensors: a
    # block's vocabulary projections then read K rows of the LM head, not all. 0: the drafter's own
    # choice (the size its file names; every token without one); -1: every token. Lossless whatever K
    # (the target verifies every draft); a smaller K drafts rare tokens less often.
    draft_vocab_size: int = 0
    # compact with a non-flat sps_table only: a request stops drafting once the survival of its next
    # draft (the product of the confidences so far) falls below this, and verifies only what it
    # drafted; 0 drafts whole blocks.
    # The stop depends on the request's own earlier drafts only, so output stays lossless.
    draft_stop_survival: float = 0.05
    # Draft only as far as speculation pays: per batch size, the engine estimates the committed tokens/s
    # of a step at each draft length (0 = plain, the powers of two below block_size, block_size; trying
    # each, re-probing the losers now and then) from the measured time of such steps and the measured
    # acceptance of each draft position, and runs the fastest. Lossless either way; false: verify whole
    # blocks on every step (spec_mode alone decides).
    adaptive_speculation: bool = True
    # Prompt lookup: where a request's last 2-3 tokens occurred earlier in its prompt or output, its
    # next drafts are the tokens that followed them (`dspark.spec.lookup`), with no drafter pass; the
    # drafter drafts the other requests' blocks. Used wherever a block is drafted apart from the target
    # step and its windows follow the drafts (every CPU step; on a GPU, compact under a measured table
    # and tensor-parallel steps; not static's blocks drafted inside, or laid out before, the target
    # step). Lossless either way.
    prompt_lookup: bool = True
    # JSON file of measured target steps/s by batch tokens; "profile": measure it when the engine starts
    # (a few seconds; compact and cap-accept only); empty means flat (verify everything: compact then
    # runs as static).
    sps_table: str = ""
    # Tokens per KV-cache page.
    kv_page_size: int = 16
    # Pages in the KV cache (target and drafter share the page table). 0: sized at start: on a GPU,
    # kv_cache_memory_fraction of the memory free once the weights are loaded, at most what max_num_seqs
    # requests of the longest context use; on the CPU 2048 pages.
    num_kv_pages: int = 0
    # With num_kv_pages 0 on a GPU: the share of the memory free after the weights that the KV cache
    # takes; the rest is left to activations, logits, CUDA graphs and the allocator's slack.
    kv_cache_memory_fraction: float = 0.8
    # Most requests decoding at once (more wait for a place; as vLLM's default).
    max_num_seqs: int = 256
    # Most target tokens in one step (verify windows plus prefill chunks). When the windows do not all
    # fit, they shorten (fewer drafts that step) rather than leave requests out, and prompts waiting to
    # prefill keep a quarter of it. A window is as long as the step's drafts (the adaptive gate's
    # choice): a plain step's windows take one token each.
    max_num_batched_tokens: int = 512
    # Longest prompt plus completion; 0 takes the model's max_position_embeddings.
    max_model_len: int = 0
    # On CUDA, target steps of up to this many tokens replay CUDA graphs (one per power-of-two token
    # and request count, on every tensor-parallel rank), and so do greedy draft blocks; all are
    # captured at start-up. 0 runs everything eagerly. A Python-driven forward launches hundreds of
    # kernels a step and is bound by the host.
    cuda_graph_max_tokens: int = 512
    # The token counts captured steps are padded up to, comma-separated (e.g. 1,2,4,8,16,32,60,96,112,128):
    # a step takes the smallest one that holds it, a larger step runs eagerly; each at most
    # cuda_graph_max_tokens and max_num_batched_tokens. Empty: powers of two to 128, then quarter steps
    # (160, 192, 224, 256, 320, ...) up to cuda_graph_max_tokens.
    cuda_graph_token_tiers: str = ""
    # GPUs one instance spreads the model over.
    tensor_parallel_size: int = 1
    # GPU indices of the tensor-parallel ranks, comma-separated (rank i on the i-th; CUDA only); empty:
    # GPUs 0 .. tensor_parallel_size-1 of those the instance can see.
    tensor_parallel_devices: str = ""
    # Seconds one tensor-parallel step may take before the engine gives up: the step's requests get an
    # error and the engine reports itself unhealthy. A rank's load gets this or 300 s, the longer.
    tensor_parallel_timeout_s: int = 300
    # Seed of the engine's own random streams (requests without a seed).
    seed: int = 0
    # Publish Prometheus metrics through Triton's metrics port.
    enable_metrics: bool = True
    # Run the engine in a process of its own (true), apart from the Triton adapter's request and response
    # I/O, so that sending responses takes no time from engine steps (one interpreter lock each); false:
    # a thread of the adapter's process.
    engine_process: bool = True
    # Overlap each step's host work with the device: a step's committed tokens are turned into text and
    # responses while the device runs the next step (one launched step ahead; the next step is still
    # scheduled after the last one's acceptance, so output is the same either way). false: each step
    # waits for its device work before the next one is scheduled and launched. A GPU only: a CPU runs a
    # step inside its launch, so there the engine waits for each step whatever this says (overlap would
    # only hold each step's tokens back a step).
    overlap_scheduling: bool = True
    # With overlap_scheduling: launch the next step before the one on the device is accepted, when
    # every running request allows (greedy, no penalties, stop strings or logprobs; plain steps or
    # drafts made inside the target step). Each window's start and anchor are completed on the device
    # from the earlier step's acceptance, so the host schedules, lays out and copies step N+1 while the
    # device runs step N. Greedy output is the same either way. false: the next step is scheduled
    # after the last one's acceptance.
    launch_ahead: bool = True
    # Steps launched back to back from one schedule (a decode burst), each completing its windows on the
    # device from the step before (its anchors, and the drafts it accepted), their tokens committed and
    # emitted together (`dspark.engine.burst`): the host schedules, accepts and emits once per burst, for
    # a target whose decode step is shorter than the host's work around it (a small model on a GPU).
    # Bursts run on one rank, while every request decodes greedily on the device and drafts (if any)
    # are made inside the target step; a step that takes prompts in is no burst, and the step after it
    # leaves newer prompts waiting so that it may burst (a prompt waits one burst at most). The gate
    # times a burst as its steps' share of its wall time. Streams then receive a burst's tokens in one
    # response. With launch_ahead, a burst whose steps replay CUDA graphs goes behind the step or burst
    # on the device, completed from its outputs there (eager bursts wait for it). Greedy output is the
    # same. 1: off. 0 (auto): GPU_DECODE_BURST on a GPU, off on a CPU. On an H100 bursts of 4 lifted
    # served tokens/s 1.13-1.34x at 8-64 streams, and offline, launched ahead, they match or beat single
    # steps launched ahead for plain decoding (1.00-1.18x at batch 1-128); on a 2-core CPU, where eager
    # bursts launch nothing ahead, plain decoding through the server ran 0.90x with them at 1 stream.
    decode_burst: int = 0
    # Responses a second each instance of the Triton adapter (a backend stub) aims at: under load a
    # request's next response waits until (the instance's requests in flight / this) seconds after its
    # previous one, carrying every token committed meanwhile (its first and final responses never
    # wait). Each response costs the server the same CPU whatever it carries (~150 us in the backend
    # stub and ~130 us in tritonserver on a 2-core CPU), so pacing keeps tokens/s up under load, at the
    # price of coarser streaming (with 4 instances, about 8 ms between a stream's responses at 64
    # streams). 0: a response whenever the engine commits tokens.
    max_responses_per_s: int = 2000
    # Testing only; empty in production. When set, the engine loop raises an injected fault at its next
    # step once this file exists (and removes the file as it fires), to test how a serving fault ends.
    fault_injection_file: str = ""

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise ValueError naming the first bad field."""
        _one_of("spec_mode", self.spec_mode, SPEC_MODES)
        _one_of("planner_policy", self.planner_policy, PLANNER_POLICIES)
        _one_of("dtype", self.dtype, DTYPES)
        _one_of("device", self.device, ("auto", "cpu", "cuda"))
        for name, minimum in (
            ("planner_lag", 1),
            ("block_size", 0),
            ("draft_vocab_size", -1),
            ("kv_page_size", 1),
            ("num_kv_pages", 0),
            ("max_num_seqs", 1),
            ("max_num_batched_tokens", 1),
            ("max_model_len", 0),
            ("cuda_graph_max_tokens", 0),
            ("tensor_parallel_size", 1),
            ("tensor_parallel_timeout_s", 1),
            ("seed", 0),
            ("max_responses_per_s", 0),
            ("decode_burst", 0),
        ):
            value = getattr(self, name)
            if value < minimum:
                raise ValueError(f"{name}: must be >= {minimum}, got {value}")
        if not 0.0 < self.kv_cache_memory_fraction <= 1.0:
            raise ValueError(
                f"kv_cache_memory_fraction: must be in (0, 1], got {self.kv_cache_memory_fraction}"
            )
        if not 0.0 <= self.draft_stop_survival < 1.0:
            raise ValueError(f"draft_stop_survival: must be in [0, 1), got {self.draft_stop_survival}")
        tiers = self.cuda_graph_tiers
        # Tiers only matter with graphs on: turning them off (0) need not clear the list.
        largest = min(self.cuda_graph_max_tokens, self.max_num_batched_tokens)
        if tiers and self.cuda_graph_max_tokens > 0 and tiers[-1] > largest:
            raise ValueError(
                f"cuda_graph_token_tiers: {tiers[-1]} is above cuda_graph_max_tokens and "
                f"max_num_batched_tokens ({largest})"
            )
        devices = self.tensor_parallel_device_ids
        if devices and len(devices) != self.tensor_parallel_size:
            raise ValueError(
                f"tensor_parallel_devices: lists {len(devices)} GPUs for tensor_parallel_size "
                f"{self.tensor_parallel_size}"
            )

    @property
    def model_path(self) -> Path:
        """The target directory, the embedded default when `model` is empty."""
        return Path(self.model) if self.model else DEFAULT_TARGET_DIR

    @property
    def draft_model_path(self) -> Path:
        """The drafter directory, the embedded default's drafter when `draft_model` is empty."""
        return Path(self.draft_model) if self.draft_model else DEFAULT_DRAFT_DIR

    @property
    def tensor_parallel_device_ids(self) -> list[int]:
        """The GPU index of each rank from `tensor_parallel_devices` ([] when unset)."""
        text = self.tensor_parallel_devices.strip()
        if not text:
            return []
        try:
            ids = [int(item) for item in text.split(",")]
        except ValueError:
            raise ValueError(
                f"tensor_parallel_devices: expected comma-separated GPU indices, got {text!r}"
            ) from None
        if any(i < 0 for i in ids) or len(set(ids)) != len(ids):
            raise ValueError(f"tensor_parallel_devices: GPU indices must be distinct and >= 0, got {text!r}")
        return ids

    @property
    def cuda_graph_tiers(self) -> list[int]:
        """The token tiers of `cuda_graph_token_tiers`, ascending without repeats ([] when unset: the
        default ladder)."""
        text = self.cuda_graph_token_tiers.strip()
        if not text:
            return []
        try:
            tiers = [int(item) for item in text.split(",")]
        except ValueError:
            raise ValueError(
                f"cuda_graph_token_tiers: expected comma-separated token counts, got {text!r}"
            ) from None
        if min(tiers) < 1:
            raise ValueError(f"cuda_graph_token_tiers: token counts must be >= 1, got {text!r}")
        return sorted(set(tiers))

    @property
    def speculative(self) -> bool:
        """True when a drafter runs."""
        return self.spec_mode != "off"

    def replace(self, **changes: Any) -> EngineConfig:
        """A copy with some fields changed."""
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_parameters(cls, parameters: dict[str, str]) -> EngineConfig:
        """Build from string key/values (config.pbtxt `parameters`); unknown keys are an error."""
        hints = get_type_hints(cls)
        known = {f.name: f for f in fields(cls)}
        values: dict[str, Any] = {}
        for key, raw in parameters.items():
            if key not in known:
                raise ValueError(f"{key}: unknown engine parameter")
            values[key] = _parse(key, raw, hints[key])
        return cls(**values)


def _parse(key: str, raw: str, kind: Any) -> Any:
    text = str(raw).strip()
    if kind is bool or kind == "bool":
        if text.lower() in ("1", "true", "yes", "on"):
            return True
        if text.lower() in ("0", "false", "no", "off"):
            return False
        raise ValueError(f"{key}: expected a boolean, got {raw!r}")
    if kind is int or kind == "int":
        try:
            return int(text)
        except ValueError:
            raise ValueError(f"{key}: expected an integer, got {raw!r}") from None
    if kind is float or kind == "float":
        try:
            return float(text)
        except ValueError:
            raise ValueError(f"{key}: expected a number, got {raw!r}") from None
    return text


def _one_of(name: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"{name}: must be one of {', '.join(allowed)}; got {value!r}")


def field_names() -> list[str]:
    """Names of every EngineConfig field, in declaration order."""
    return [f.name for f in fields(EngineConfig)]
