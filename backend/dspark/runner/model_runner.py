"""ModelRunner: runs this rank's target shard over one step's packed windows.

The driver builds a `TargetStep` (plain tensors, cheap to broadcast) once per step; every rank turns
it into the same AttentionBatch and runs the same forward, so ranks never plan anything themselves.
With tensor_parallel_size > 1, `TensorParallelRunner` is the driver's runner: it hands each step to
the spawned ranks 1..N-1 (dspark.parallel.tp_worker) and runs rank 0's shard itself.
"""

from __future__ import annotations

import atexit
import json
import logging
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Protocol

import torch
from safetensors import safe_open

from dspark.config import EngineConfig
from dspark.parallel.distributed import (
    SINGLE,
    TensorParallel,
    check_no_group,
    join_group,
    leave_group,
    rendezvous_store,
)
from dspark.parallel.tp_worker import WorkerGroup, collective_timeout_s
from dspark.runner.attention_batch import AttentionBatch
from dspark.runner.cuda_graphs import CaptureOutcome, CudaGraphs
from dspark.runner.deferred_inputs import DeferredInputs
from dspark.runner.host_to_device import to_device
from dspark.runner.kv_cache import PagedKVCache
from dspark.runner.models.hf_config import ModelConfig
from dspark.runner.models.layers import measure_cpu_linear_paths
from dspark.runner.models.llama import CausalLM
from dspark.runner.models.loader import load_target_model
from dspark.runner.verify_tokens import VerifyDrafts

logger = logging.getLogger(__name__)


class FeatureConsumer(Protocol):
    """What takes a step's captured target features (features [T, L * hidden], positions [T], slots [T];
    padding: slot -1): the drafter's KV injection, now or later (`keep` and `flush` are called only where
    the runner keeps features: `ModelRunner.set_feature_consumer`)."""

    def inject(self, features: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor) -> None:
        """Inject them now (captured into the step's graph when it replays one: device work only)."""

    def keep(self, features: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor) -> None:
        """Keep them (copies: they may be buffers the next step rewrites), injected by `flush`."""

    def flush(self) -> None:
        """Inject everything kept, in the order it was kept."""


@dataclass(frozen=True)
class TargetStep:
    """One target forward: packed tokens and where each window sits in its request's pages.

    token_ids, positions: [num_tokens] int64 (positions None: each window's run from its start, laid
    out on the device with the rest of the layout); window_starts / window_lens / pages: per window;
    logit_rows: [num_logit_rows] packed rows whose logits the driver needs; capture_layers: target
    layers whose outputs feed the drafter.
    """

    token_ids: torch.Tensor
    positions: torch.Tensor | None
    window_starts: list[int]
    window_lens: list[int]
    pages: list[list[int]]
    logit_rows: torch.Tensor
    capture_layers: tuple[int, ...]
    # Whether `run` moves the logit rows to the host (benchmarks); the engine leaves them on the
    # device, where it accepts and samples, and only committed tokens cross to the host.
    host_logits: bool = True
    # The drafts of the first windows (verify windows, whose token_ids rows after the anchor are
    # placeholders): packed in where the step runs, made inside it first if they are still to be made
    # (`VerifyDrafts`); None: token_ids are complete.
    drafts: VerifyDrafts | None = None
    # What the first windows take from the step before, not yet accepted when this one was packed
    # (their starts and anchors, on the device); None: the windows are complete.
    deferred: DeferredInputs | None = None
    # False: the logits stay in the model's dtype. When every request decides its tokens by the argmax
    # alone, fp32 logits would only feed the argmax, which the exact conversion cannot change: one
    # kernel and a [rows, vocab] fp32 write and read fewer a step.
    fp32_logits: bool = True
    # True: run eagerly, the captured features are kept (`FeatureConsumer.keep`) and injected before the
    # drafter next reads its context, not in this step: a step that verifies no draft (the gate chose
    # plain decoding) then projects nothing, and a run of them is injected in one pass, its weights read
    # once, or never if the drafter is not run again (where the runner keeps features:
    # `ModelRunner.set_feature_consumer`). A replayed step injects inside its graph, whatever this says.
    keep_features: bool = False

    def with_host_tokens(self) -> tuple[TargetStep, object]:
        """This step with every token id on the host (what other ranks are sent), the verify windows'
        drafts made if need be and packed in; and the drafts made doing so (None if none were)."""
        assert self.deferred is None, "a step whose inputs are still on the device stays on one rank"
        if self.drafts is None:
            return self, None
        token_ids = self.token_ids.clone()
        made = self.drafts.pack(self.token_ids, self.window_lens, token_ids, in_layout=False)
        return replace(self, token_ids=token_ids, drafts=None), made


@dataclass(frozen=True)
class TargetResult:
    """What the driver gets back: logits [num_logit_rows, vocab] fp32, or in the model's dtype when the
    step says so (on the host after `run` when the step asks for host logits, else on the device), their
    argmax [num_logit_rows] int64 (on the device: acceptance runs there), captured features [num_tokens,
    len(capture_layers) * hidden] on the device (or None), and each token's cache slot (after a replay,
    features and slots are views that the next step overwrites); and the drafts the step made while
    packing its verify windows (`VerifyDrafts.pack`; None if it made none)."""

    logits: torch.Tensor | None
    features: torch.Tensor | None
    slots: torch.Tensor
    argmax: torch.Tensor | None = None
    drafts: object = None


class ModelRunner:
    """Owns the target shard and its KV cache on one device."""

    def __init__(
        self, model: CausalLM, cache: PagedKVCache, device: torch.device, graphs: CudaGraphs | None = None
    ) -> None:
        self.model = model
        self.cache = cache
        self.device = device
        # Captured forwards for steps that fit them (CUDA, one rank); None: every step runs eagerly.
        self.graphs = graphs
        self.features: FeatureConsumer | None = None
        # Whether an eager step that asks to keep its features (`TargetStep.keep_features`) may, and
        # whether some are kept now (flushed before the next step that injects).
        self.keeps_features = False
        self._kept = False

    def use_graphs(self, graphs: CudaGraphs | None) -> None:
        """Replay steps through `graphs` (None: run every step eagerly), feeding the feature consumer."""
        self.graphs = graphs
        if graphs is not None:
            graphs.set_feature_sink(self.features.inject if self.features is not None else None)

    def capture_graphs(self, capture_layers: tuple[int, ...]) -> CaptureOutcome | None:
        """Capture every step graph now (start-up), so that no step stalls on a capture; every
        tensor-parallel rank calls this at once, and they capture the same tiers (`capture_all`). When
        no tier is captured (none fits, or a capture failed on some rank), every rank runs eagerly.
        None: no graphs."""
        if self.graphs is None:
            return None
        tp = self.model.tp
        outcome = self.graphs.capture_all(capture_layers, tp)
        if not outcome.replays:
            self.use_graphs(None)
        if tp.rank == 0:  # the driver speaks for the group
            log_capture(outcome)
        return outcome

    def release_graphs(self) -> None:
        """Drop every captured graph. A graph that captured NCCL collectives pins its communicator, so
        this must come before the TP group is destroyed, or the destroy waits forever."""
        if self.graphs is not None:
            self.graphs.release()

    def set_feature_consumer(self, consumer: FeatureConsumer | None, keeps: bool) -> None:
        """Hand every step's captured features (all its tokens: positions, slots) to `consumer` right
        after the forward: injected inside the step's CUDA graph when it replays one, or, run eagerly,
        kept where the step says so and `keeps` allows. Whatever was kept is injected before any step
        that injects (`_flush_kept`).

        Why eager steps only: on the CPU a plain step's projection is ~2% of it (8 requests), while a
        graph's captured injection costs no launch; on an H100 at 64 requests, plain steps replaying
        graphs without it and their features injected before the next block ran 0.91x (session 62)."""
        self.features = consumer
        self.keeps_features = keeps and consumer is not None
        if self.graphs is not None:
            self.graphs.set_feature_sink(consumer.inject if consumer is not None else None)

    def _flush_kept(self) -> None:
        """Before a step that injects (or drafts inside itself, reading the drafter's context): inject
        what earlier steps kept, so the context is written in step order (a kept row may name a slot
        this step writes again: a page freed and taken by another request)."""
        if self._kept:
            self._kept = False
            self.features.flush()

    @classmethod
    def create(
        cls, config: EngineConfig, device: torch.device, dtype: torch.dtype, tp: TensorParallel = SINGLE
    ) -> ModelRunner:
        """Load this rank's shard of the target (the whole target for SINGLE) and its KV cache shard."""
        model = load_target_model(config.model_path, dtype=dtype, device=device, tp=tp)
        if device.type == "cpu":
            # Each row count by F.linear, with the weight first, or over a packed copy (oneDNN's, MKL's):
            # the host's BLAS decides which is faster (CpuLinearPaths).
            logger.info("CPU linears by rows: %s", measure_cpu_linear_paths(model).describe())
        cfg = model.config
        cache = PagedKVCache(
            cfg.num_layers,
            config.num_kv_pages,
            config.kv_page_size,
            model.num_local_kv_heads,
            cfg.head_dim,
            dtype,
            device,
        )
        graphs = None
        # Tensor-parallel ranks capture too: every rank takes the same steps, so each replays the same
        # tier's graph and the NCCL collectives captured in it meet.
        if device.type == "cuda" and config.cuda_graph_max_tokens > 0:
            graphs = CudaGraphs.from_config(model, cache, device, config)
        return cls(model, cache, device, graphs)

    @property
    def model_config(self) -> ModelConfig:
        """The target's architecture."""
        return self.model.config

    def vocab_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Full (embedding, LM head) weights [vocab, hidden], which the drafter shares."""
        return self.model.embed_tokens.weight, self.model.lm_head.weight

    def replays(self, step: TargetStep) -> bool:
        """Whether the step replays a captured graph (else it runs eagerly)."""
        return self.graphs is not None and self.graphs.tiers_of(len(step.token_ids), step.pages) is not None

    def run(self, step: TargetStep) -> TargetResult:
        """Forward the step's windows; logits only at `logit_rows`."""
        result = self.forward(step)
        logits = result.logits
        assert logits is not None
        # The argmax stays where the logits are: acceptance reads it there, and only the committed
        # tokens cross to the host, not [rows, vocab] floats.
        argmax = logits.argmax(dim=-1)
        return replace(result, logits=logits.cpu() if step.host_logits else logits, argmax=argmax)

    @torch.inference_mode()
    def run_following(
        self,
        step: TargetStep,
        anchors: torch.Tensor,
        accepted: torch.Tensor | None = None,
        anchor_rows: torch.Tensor | None = None,
    ) -> TargetResult | None:
        """The step after `step`, a decode-only step that just replayed a graph, replayed from the static
        layout moved on on the device, with nothing copied from the host: each window on by its anchor
        and the drafts that step accepted (`accepted` [windows], None: none), its anchor from `anchors`
        [windows] (written at `anchor_rows` [windows] of the packed tokens when the windows verify
        drafts; one-token windows are their own rows), and a step with in-step drafts (`InStepDrafts`)
        drafting into the layout again. Logits and argmax of every row as `run` leaves them on the
        device. None, with nothing run, when `step` runs eagerly (pack the next one)."""
        graphs, drafts = self.graphs, step.drafts
        tiers = None if graphs is None else graphs.tiers_of(len(step.token_ids), step.pages)
        if graphs is None or tiers is None:
            return None
        num_rows = step.logit_rows.shape[0]
        assert num_rows == len(step.token_ids), "every row of a decode-only step has logits"
        self._flush_kept()
        made = None
        if drafts is None:
            graphs.layout.advance_decode(len(step.window_lens), anchors)
        else:
            assert anchor_rows is not None, "verify windows' anchors need their rows"
            graphs.layout.advance_verify(len(step.window_lens), accepted, anchors, anchor_rows)
            made = drafts.pack(step.token_ids, step.window_lens, graphs.layout.token_ids, True)
        replayed = graphs.replay(tiers, num_rows, step.capture_layers)
        logits = self.model.compute_logits(replayed.hidden[:num_rows], step.fp32_logits)
        return TargetResult(
            logits, replayed.features, replayed.slots, argmax=logits.argmax(dim=-1), drafts=made
        )

    @torch.inference_mode()
    def forward(self, step: TargetStep) -> TargetResult:
        """`run` with the logits left on the device: what every tensor-parallel rank executes."""
        rows = step.logit_rows
        num_rows = rows.shape[0]
        # Rows are increasing: the first and last tell a leading run (every row of an all-verify or
        # all-decode step), which is a view, with no copy or gather.
        leading = num_rows == 0 or (int(rows[0]) == 0 and int(rows[-1]) == num_rows - 1)
        # Queued before the forward, so that nothing after it waits for the device.
        logit_rows = slice(0, num_rows) if leading else to_device(rows, self.device)
        drafts = step.drafts
        if self.graphs is not None:
            num_verify = drafts.num_windows if drafts is not None else 0
            tiers = self.graphs.fill(
                step.token_ids, step.pages, step.window_starts, step.window_lens, num_verify, step.deferred
            )
            if tiers is not None:
                self._flush_kept()
                made = None
                if drafts is not None:  # into the filled layout, where an in-step draft block reads
                    made = drafts.pack(step.token_ids, step.window_lens, self.graphs.layout.token_ids, True)
                replayed = self.graphs.replay(tiers, len(step.token_ids), step.capture_layers)
                logits = self.model.compute_logits(replayed.hidden[logit_rows], step.fp32_logits)
                return TargetResult(logits, replayed.features, replayed.slots, drafts=made)
        # A copy even on the host: deferred inputs write the anchors into it.
        token_ids = to_device(step.token_ids, self.device)
        if step.deferred is not None and token_ids is step.token_ids:
            token_ids = token_ids.clone()
        batch = AttentionBatch.build(
            step.pages,
            step.window_starts,
            step.window_lens,
            self.cache.page_size,
            True,
            self.device,
            token_ids=token_ids,
            deferred=step.deferred,
            rotary_table=self.model.cos_sin,
        )
        positions = batch.positions if step.positions is None else to_device(step.positions, self.device)
        keeps = step.keep_features and self.keeps_features
        if not keeps:
            self._flush_kept()
        made = None
        if drafts is not None:
            made = drafts.pack(step.token_ids, step.window_lens, token_ids, False)
        hidden, features = self.model(token_ids, positions, batch, self.cache, step.capture_layers)
        if features is not None and self.features is not None:
            if keeps:
                self.features.keep(features, positions, batch.slots)
                self._kept = True
            else:
                self.features.inject(features, positions, batch.slots)
        logits = self.model.compute_logits(hidden[logit_rows], step.fp32_logits)
        return TargetResult(logits, features, batch.slots, drafts=made)

    def close(self) -> None:
        """Nothing to release for a single-process runner."""


# Intra-op threads of each tensor-parallel rank on a GPU (see TensorParallelRunner.create).
GPU_RANK_THREADS = 4


class TensorParallelRunner:
    """The driver's runner for tensor_parallel_size > 1: rank 0's shard in this process, ranks
    1..N-1 in spawned worker processes, every step planned here once and broadcast."""

    def __init__(
        self,
        local: ModelRunner,
        workers: WorkerGroup,
        config: EngineConfig,
        dtype: torch.dtype,
        threads_before: int,
    ) -> None:
        self.local = local
        self.workers = workers
        self.config = config
        self.dtype = dtype
        self.device = local.device
        self._threads_before = threads_before
        self._vocab_weights: tuple[torch.Tensor, torch.Tensor] | None = None
        self._closed = False

    @classmethod
    def create(cls, config: EngineConfig, device: torch.device, dtype: torch.dtype) -> TensorParallelRunner:
        """Check the split, spawn ranks 1..N-1, load rank 0's shard meanwhile, then join the group."""
        size = config.tensor_parallel_size
        check_shardable(ModelConfig.load(config.model_path), size)
        devices = rank_devices(config, device)
        check_no_group()
        if devices[0].type == "cuda":
            torch.cuda.set_device(devices[0])  # "cuda" (the drafter's device) now means rank 0's GPU
        timeout = collective_timeout_s(config)
        store = rendezvous_store(0, timeout)
        # The ranks share this host's cores: each, the driver too, gets its share of threads. GPU ranks
        # get a few at most: their host work is small tensors, where a wide parallel region costs more
        # in wake-ups than it saves, and N ranks' thread pools plus NCCL's busy proxy threads would
        # oversubscribe the cores (two H200 ranks with 16 + 32 threads each: 17 ms of host work a step).
        threads_before = torch.get_num_threads()
        threads = max(1, threads_before // size)
        if devices[0].type == "cuda":
            threads = min(threads, GPU_RANK_THREADS)
        workers = WorkerGroup.spawn(config, devices, dtype, store.port, threads, ModelRunner.create)
        torch.set_num_threads(threads)
        try:
            local = ModelRunner.create(config, devices[0], dtype, tp=TensorParallel(0, size))
            workers.wait_loaded()
            join_group(0, size, store, timeout, devices[0])
        except BaseException:
            workers.stop(graceful=False)
            leave_group()
            torch.set_num_threads(threads_before)
            raise
        workers.start_watchdog()
        runner = cls(local, workers, config, dtype, threads_before)
        atexit.register(runner.close)
        return runner

    @property
    def model_config(self) -> ModelConfig:
        """The target's architecture."""
        return self.local.model_config

    @property
    def worker_pids(self) -> list[int]:
        """Process ids of ranks 1..N-1."""
        return self.workers.pids

    def capture_graphs(self, capture_layers: tuple[int, ...]) -> None:
        """Capture every step graph on every rank now, the same tiers in the same order (the collectives
        inside each capture pair up across ranks; see `CudaGraphs.capture_all`), or none on any rank;
        nothing to do where steps run eagerly (CPU, gloo)."""
        if self.local.graphs is None:
            return
        self.workers.send(("capture", tuple(capture_layers)))
        try:
            with self.workers.step():
                self.local.capture_graphs(capture_layers)
        except Exception as exc:
            raise self.workers.fail(f"graph capture failed on rank 0: {exc}") from exc
        self.workers.check()

    def set_feature_consumer(self, consumer: FeatureConsumer | None, keeps: bool) -> None:
        """Rank 0's features feed the consumer (the drafter lives on the driver; the residual stream, and
        so every captured feature, is replicated over ranks)."""
        self.local.set_feature_consumer(consumer, keeps)

    def vocab_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Full (embedding, LM head) weights [vocab, hidden] for the drafter, read from the checkpoint
        (this rank's model holds only its vocabulary shard of each)."""
        if self._vocab_weights is None:
            self._vocab_weights = read_vocab_weights(
                self.config.model_path, self.model_config, self.dtype, self.device
            )
        return self._vocab_weights

    def replays(self, step: TargetStep) -> bool:
        """Whether the step replays a captured graph (every rank captured the same tiers)."""
        return self.local.replays(step)

    def run(self, step: TargetStep) -> TargetResult:
        """Broadcast the step, run rank 0's share; logits gathered over ranks, features are rank 0's
        (the residual stream is replicated). TensorParallelError, within tensor_parallel_timeout_s,
        when a rank dies or hangs."""
        step, made = step.with_host_tokens()
        self.workers.send(("step", step))
        try:
            with self.workers.step():
                result = replace(self.local.run(step), drafts=made)
        except Exception as exc:
            raise self.workers.fail(f"step failed on rank 0: {exc}") from exc
        except BaseException:  # interrupted mid-step: the ranks are out of step for good
            self.workers.fail("step interrupted on rank 0")
            raise
        self.workers.check()
        return result

    def close(self) -> None:
        """Shut ranks 1..N-1 down and leave the group (idempotent; also runs at exit)."""
        if self._closed:
            return
        self._closed = True
        self.workers.stop()
        self.local.release_graphs()
        leave_group()
        torch.set_num_threads(self._threads_before)
        atexit.unregister(self.close)


def log_capture(outcome: CaptureOutcome) -> None:
    """Say where a start-up capture departed from the plan: a rank that could capture fewer tiers, the
    tiers every rank captured instead, a failed capture (on which rank, at which size)."""
    for rank, budget in enumerate(outcome.budgets):
        if budget != outcome.planned:
            logger.warning(
                "cuda graph capture: rank %d can capture token tiers %s of %s", rank, budget, outcome.planned
            )
    if outcome.tiers != outcome.planned:
        logger.warning("cuda graph capture: every rank captures token tiers %s", outcome.tiers)
    if outcome.failed_rank is not None:
        tokens, requests = outcome.failed_at or (0, 0)
        logger.error(
            "cuda graph capture failed on rank %d at tokens=%d requests=%d: every rank runs eagerly",
            outcome.failed_rank,
            tokens,
            requests,
        )


def create_runner(
    config: EngineConfig, device: torch.device, dtype: torch.dtype
) -> ModelRunner | TensorParallelRunner:
    """The runner for this config: in-process for one rank, a worker group for more."""
    if config.tensor_parallel_size > 1:
        return TensorParallelRunner.create(config, device, dtype)
    return ModelRunner.create(config, device, dtype)


def check_shardable(cfg: ModelConfig, size: int) -> None:
    """ValueError naming tensor_parallel_size unless heads, KV heads and the MLP split evenly."""
    tp = TensorParallel(0, size)
    tp.shard(cfg.num_heads, "num_attention_heads")
    tp.shard(cfg.num_kv_heads, "num_key_value_heads")
    tp.shard(cfg.intermediate_size, "intermediate_size")


def rank_devices(config: EngineConfig, device: torch.device) -> list[torch.device]:
    """The device of each rank: GPU i (or the i-th of tensor_parallel_devices) on CUDA, else the CPU."""
    size = config.tensor_parallel_size
    if device.type != "cuda":
        return [device] * size
    visible = torch.cuda.device_count()
    ids = config.tensor_parallel_device_ids or list(range(size))
    if size > visible:
        raise ValueError(f"tensor_parallel_size ({size}) needs {size} GPUs, but {visible} are visible")
    if max(ids) >= visible:
        raise ValueError(f"tensor_parallel_devices: GPU {max(ids)} is not visible ({visible} GPUs)")
    return [torch.device("cuda", i) for i in ids]


def read_vocab_weights(
    model_dir: Path, cfg: ModelConfig, dtype: torch.dtype, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """(embedding, LM head) [vocab, hidden] straight from a checkpoint; tied: one tensor twice."""
    names = {"embed_tokens.weight": "embedding", "lm_head.weight": "lm_head"}
    found: dict[str, torch.Tensor] = {}
    for file in _safetensors_files(model_dir):
        with safe_open(str(model_dir / file), framework="pt") as f:
            for key in f.keys():
                if key.removeprefix("model.") in names:
                    found[names[key.removeprefix("model.")]] = f.get_tensor(key).to(device, dtype)
    if cfg.tie_word_embeddings and "embedding" in found:
        found["lm_head"] = found["embedding"]
    missing = sorted({"embedding", "lm_head"} - set(found))
    if missing:
        raise KeyError(f"model: checkpoint in {model_dir} lacks the {' and '.join(missing)} weights")
    return found["embedding"], found["lm_head"]


def _safetensors_files(model_dir: Path) -> list[str]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        return sorted(set(json.loads(index.read_text())["weight_map"].values()))
    return sorted(p.name for p in model_dir.glob("*.safetensors"))
