"""What a level-2 trial measures in every rank, and how it reports and ends.

A step is one optimizer step, timed from the end of the previous one to the end of this one, so
the time includes everything the loop does in between: loading data, forward, backward and
communication, as the user's job will. After ``warmup`` steps, ``measured`` steps are timed;
every rank takes each step's slowest rank, and the median gives the throughput (samples a
second over the job) with the spread of the steps. The peak memory is the highest of any rank.
Then every rank writes its part, rank 0 the result, and the trial's processes end.

A rank that fails writes why instead (:func:`install_failure_report`): ``oom`` for an
out-of-memory error of any allocator, ``crash`` with the tail of its traceback otherwise. The
launcher reads these files; it never guesses from a process's output.
"""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import sys
import time
import traceback
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._pytree import tree_leaves

from distune.errors import DistuneError
from distune.trial_settings import MICRO_BATCH, PROGRESS_FILE, RESULT_FILE, TrialSettings
from distune.worker_runtime.memory_cap import LiveTensorBytes, MemoryMeter, start_meter
from distune.worker_runtime.topology import NODE_VAR

if TYPE_CHECKING:
    from distune.worker_runtime.reducer import Reducer

_TRACEBACK_TAIL_LINES = 12
_OOM_MESSAGES = ("out of memory", "can't allocate memory", "DefaultCPUAllocator")
#: The result's ``api``: how the script took its configuration.
PREPARE = "prepare"
WRAPPER = "wrapper"
#: True while ``distune.prepare`` builds its wrappers: they are measured by prepare.
_PREPARING: ContextVar[bool] = ContextVar("distune_preparing", default=False)
#: A model's sizes a trial reports; a process's models add up, but for the facts picked
#: (``largest_block_bytes``: the largest; ``repeated_block_classes``: the fewest, since ZeRO-3
#: and checkpointing need blocks in every model).
_SUMMED_FACTS = ("parameter_bytes", "gradient_bytes", "optimizer_state_bytes", "batch_norms")
_PICKED_FACTS: dict[str, Callable[[int, int], int]] = {
    "largest_block_bytes": max,
    "repeated_block_classes": min,
}


class TrialStepError(DistuneError, RuntimeError):
    """A trial's steps do not match its configuration; the message says what differed."""


class DivergedError(TrialStepError):
    """The model's trained parameters went NaN or inf in the trial's steps: the configuration
    does not train (its loss diverged at this micro-batch or precision)."""


@dataclass
class _ProcessMeasure:
    """A process's one memory meter and, in a trial, its one measurement, whatever the
    number of models it hands to distune (a GAN's two ``prepare`` calls)."""

    meter: MemoryMeter
    #: The job's default process group: a new one (a test's next job) starts afresh.
    group: object
    measurement: TrialMeasurement | None = None


#: This process's meter and measurement, once the first model started them.
_PROCESS: ContextVar[_ProcessMeasure | None] = ContextVar("distune_process", default=None)


def process_meter(
    device: torch.device, cap: int | None, tensors: Iterable[torch.Tensor]
) -> tuple[MemoryMeter, TrialMeasurement | None]:
    """This process's meter, counting ``tensors`` (a model's parameters and buffers), and the
    measurement an earlier model started (None for the first). The first model starts the
    meter; a later one's tensors join it, so the peak and the cap count every model: a meter
    each would miss the others' parameters, made before it started."""
    active = _PROCESS.get()
    if active is None or active.group is not dist.group.WORLD:
        meter = start_meter(device, cap, tensors)
        _PROCESS.set(_ProcessMeasure(meter, dist.group.WORLD))
        return meter, None
    if isinstance(active.meter, LiveTensorBytes):
        active.meter.track(tensors)
    return active.meter, active.measurement


def measures_trial(measurement: TrialMeasurement) -> None:
    """Record ``measurement`` as this process's (after :func:`process_meter`): later models
    add their sizes to it."""
    active = _PROCESS.get()
    assert active is not None, "process_meter starts the process's measure"
    active.measurement = measurement


@contextlib.contextmanager
def preparing() -> Iterator[None]:
    """Around ``distune.prepare``'s wrapping: a DistributedDataParallel made inside is not
    measured by itself (prepare measures the optimizer's steps)."""
    token = _PREPARING.set(True)
    try:
        yield
    finally:
        _PREPARING.reset(token)


def write_json(path: Path, data: dict[str, Any]) -> None:
    """Write ``data`` so that a reader sees the old file or the whole new one."""
    partial = path.with_name(f".{path.name}.{os.getpid()}")
    partial.write_text(json.dumps(data), encoding="utf-8")
    os.replace(partial, path)


def writes_progress(rank: int, environ: Mapping[str, str]) -> bool:
    """Whether ``rank`` writes its node's progress file, which that node's launcher watches:
    the node's first rank, one per node. Torch's agent numbers a node's ranks from
    ``GROUP_RANK`` x ``LOCAL_WORLD_SIZE`` (level 2's nodes run the same job, so equal numbers);
    ``LOCAL_RANK`` cannot tell, since ``--virtual-local-rank`` makes it 0 in every rank.
    Without a launcher's variables the job is one node, and rank 0 writes."""
    node = int(environ.get(NODE_VAR, "0"))
    per_node = int(environ.get("LOCAL_WORLD_SIZE", "1"))
    return rank == node * per_node


def write_rank_outcome(trial_dir: Path, rank: int, outcome: str, **details: Any) -> None:
    """Write how this rank's part of the trial ended (``ok``, ``oom``, ``crash``) where the
    launcher collects every rank's, with ``details`` (the error, the peak memory) and when
    (``time``, seconds since the epoch): of several crashed ranks the first to fail is the
    cause, its peers failed after it in their collectives."""
    report = {"rank": rank, "outcome": outcome, **details, "time": time.time()}
    write_json(trial_dir / f"rank{rank}.json", report)


def is_out_of_memory(error: BaseException) -> bool:
    """Whether ``error`` (or what caused it) is an allocator running out of memory."""
    seen: BaseException | None = error
    while seen is not None:
        if isinstance(seen, torch.OutOfMemoryError | MemoryError) or any(
            text in str(seen) for text in _OOM_MESSAGES
        ):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def install_failure_report(trial_dir: Path, rank: int) -> None:
    """Make an uncaught exception in this rank write its outcome before the process ends."""
    previous = sys.excepthook

    def report(kind: type[BaseException], error: BaseException, tb: TracebackType | None) -> None:
        lines = "".join(traceback.format_exception(kind, error, tb)).splitlines()
        outcome = "oom" if is_out_of_memory(error) else "crash"
        tail = "\n".join(lines[-_TRACEBACK_TAIL_LINES:])
        # A diverged configuration is a crash the search treats by its micro-batch (as an
        # out of memory), not by its strategy: it says so in a field, not only in words.
        diverged = {"diverged": True} if isinstance(error, DivergedError) else {}
        write_rank_outcome(trial_dir, rank, outcome, error=tail, **diverged)
        previous(kind, error, tb)

    sys.excepthook = report


class TrialMeasurement:
    """Times optimizer steps of one rank, then reports and ends the trial's process."""

    def __init__(
        self,
        trial_dir: Path,
        meter: MemoryMeter,
        samples_per_step: int,
        micro_batch: int,
        warmup: int,
        measured: int,
        device: torch.device,
        describe: Callable[[], dict[str, Any]],
        accumulation: int = 1,
    ) -> None:
        self.trial_dir = trial_dir
        self.meter = meter
        self.samples_per_step = samples_per_step
        self.micro_batch = micro_batch
        self.warmup = warmup
        self.measured = measured
        self.device = device
        self.rank = dist.get_rank()
        self._writes_progress = writes_progress(self.rank, os.environ)
        self._describe = describe
        self._steps = 0
        self._last = time.perf_counter()
        self._durations: list[float] = []
        self._forward_start = 0
        self._activation_bytes = 0
        # Per forward: what the repeated blocks kept, their inputs, the largest block's share.
        self._block_start: dict[int, int] = {}
        self._blocks_kept = self._blocks_input = self._block_max = 0
        self._checkpointed_bytes = 0
        #: Whether the first training forward is checked against the micro-batch (prepare's).
        self._check_micro_batch = True
        #: The dimensions of the first training forward's first input tensor that hold the
        #: micro-batch: the launcher compares a trial's with the profile's (``batch_moved``).
        self.batch_dimensions: list[int] = []
        #: The accumulation steps ``prepare`` set; each step's micro-steps are checked against it.
        self.accumulation = accumulation
        #: Training forwards of the model in this optimizer step.
        self._forwards = 0
        #: The ``run.accumulate(i)`` micro-steps of this optimizer step, in order.
        self._micro_steps: list[int] = []
        #: The sizes of the process's later models, read when the trial reports.
        self._more_models: list[Callable[[], dict[str, int]]] = []
        #: The model whose steps are measured (its parameters are checked at the end).
        self._model: nn.Module | None = None

    def add_model(self, facts: Callable[[], dict[str, int]]) -> None:
        """Count a later model of the process in the sizes the trial reports (``facts()``,
        read at the end: its optimizer state exists after steps); its forwards and steps are
        not counted: the first model's optimizer steps are the trial's steps."""
        self._more_models.append(facts)

    def _description(self) -> dict[str, Any]:
        described = self._describe()
        for more in self._more_models:
            facts = more()
            for key in _SUMMED_FACTS:
                described[key] += facts[key]
            for key, pick in _PICKED_FACTS.items():
                if key in facts:  # a wrapped model has no block classes
                    described[key] = pick(described[key], facts[key])
        return described

    def attach(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        blocks: tuple[type[nn.Module], ...] = (),
    ) -> None:
        """Time ``optimizer``'s steps and watch ``model``'s forwards (activation bytes), and
        its repeated ``blocks``' (what checkpointing them would keep instead)."""
        optimizer.register_step_post_hook(self._after_step)
        self._watch(model, blocks)

    def _watch(self, model: nn.Module, blocks: tuple[type[nn.Module], ...]) -> None:
        self._model = model
        model.register_forward_pre_hook(self._before_forward)
        model.register_forward_hook(self._after_forward)
        for module in model.modules():
            if isinstance(module, blocks):
                module.register_forward_pre_hook(self._before_block)
                module.register_forward_hook(self._after_block)
        (self.trial_dir / f"pid.{self.rank}").write_text(str(os.getpid()), encoding="utf-8")

    def _end_if_out_of_memory(self) -> None:
        """End the trial as ``oom`` once an out-of-memory error was raised in this rank, even
        if the script caught it and went on (fairseq-style, skipping the batch): the
        configuration does not fit, and its steps from then on (a skipped micro-step, a rank
        out of step with the others) measure nothing or fail as something else."""
        error = self.meter.out_of_memory()
        if error is None:
            return
        write_rank_outcome(
            self.trial_dir,
            self.rank,
            "oom",
            error=f"{error} (the script caught the error and went on)",
        )
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)  # the trial is over; its peers fail in their next collective

    def _before_forward(self, module: nn.Module, inputs: tuple[Any, ...]) -> None:
        self._end_if_out_of_memory()
        # A training forward: an evaluation (no_grad, or eval mode) is no micro-step.
        if torch.is_grad_enabled() and module.training:
            self._forwards += 1
            if self._check_micro_batch:
                self._check_first_input(inputs)
        self._forward_start = self.meter.live_bytes()
        self._blocks_kept = self._blocks_input = self._block_max = 0

    def _check_first_input(self, inputs: tuple[Any, ...]) -> None:
        """The first training forward's input must hold the trial's micro-batch somewhere in
        its shape: a script that built its batches from its own flags, not from the micro-batch
        ``prepare`` returned, would be measured as a configuration it never ran."""
        self._check_micro_batch = False  # once: the first forward says how batches are built
        first = _first_batched_tensor(inputs)
        if first is not None:
            self.batch_dimensions = [i for i, n in enumerate(first.shape) if n == self.micro_batch]
        if first is not None and self.micro_batch not in first.shape:
            raise TrialStepError(
                f"distune trial: distune.prepare set the micro-batch to {self.micro_batch}, but "
                f"the model's first forward took an input of shape {tuple(first.shape)}: build "
                "each micro-batch with run.micro_batch_size samples, and run "
                "run.gradient_accumulation_steps of them a step, not the script's own values"
            )

    def micro_step(self, index: int) -> None:
        """Called by ``run.accumulate(index)``: the step's micro-steps are checked at its end."""
        if index == 0 and self._micro_steps == list(range(self.accumulation)):
            # A whole step's micro-steps ran and no optimizer step followed: a gradient scaler
            # skipped it (an fp16 overflow, as in AMP's first steps). The iteration is over.
            self._end_step()
        self._micro_steps.append(index)

    def _check_step(self) -> None:
        """A step must run the trial's accumulation steps: a script that loops over its own
        count (not ``run.gradient_accumulation_steps``) trains another global batch, and under
        fewer micro-steps than ``prepare`` set it never averages its gradients at all."""
        if self._forwards == 0:
            raise TrialStepError(
                "distune trial: this optimizer step ran no training forward through run.model, "
                "the model distune.prepare returned: a forward through the script's own model "
                "(or run.model.module) leaves its gradients unaveraged, and the trial would "
                "measure a job that never communicates; run the forwards as run.model(x)"
            )
        wanted = self.accumulation
        if self._micro_steps:
            if self._micro_steps == list(range(wanted)):
                return
            ran = f"run.accumulate({', '.join(map(str, self._micro_steps[:8]))}"
            ran += ", ...)" if len(self._micro_steps) > 8 else ")"
        elif self._forwards >= wanted and self._forwards % wanted == 0:
            return  # without run.accumulate, whole micro-steps are all that can be told
        else:
            ran = f"{self._forwards} training forward(s) of the model"
        raise TrialStepError(
            f"distune trial: distune.prepare set gradient_accumulation_steps to {wanted}, but "
            f"this optimizer step ran {ran}: run one micro-step for each i in "
            "range(run.gradient_accumulation_steps), each under run.accumulate(i), then step "
            "the optimizer; the script's own accumulation count would train another global batch"
        )

    def _after_forward(self, *_: Any) -> None:
        # What the forward left alive is what autograd saved for backward: the activations.
        kept = self.meter.live_bytes() - self._forward_start
        self._activation_bytes = max(self._activation_bytes, kept)
        # Checkpointed blocks keep only their inputs, and recompute one block at a time.
        checkpointed = kept - self._blocks_kept + self._blocks_input + self._block_max
        self._checkpointed_bytes = max(self._checkpointed_bytes, checkpointed)

    def _before_block(self, module: nn.Module, inputs: tuple[Any, ...]) -> None:
        self._block_start[id(module)] = self.meter.live_bytes()

    def _after_block(self, module: nn.Module, inputs: tuple[Any, ...], _output: Any) -> None:
        kept = self.meter.live_bytes() - self._block_start.pop(id(module), 0)
        self._blocks_kept += kept
        self._block_max = max(self._block_max, kept)
        self._blocks_input += sum(
            t.numel() * t.element_size() for t in inputs if isinstance(t, torch.Tensor)
        )

    def _after_step(self, *_: Any) -> None:
        self._end_if_out_of_memory()
        self._check_step()
        self._end_step()

    def _end_step(self) -> None:
        """An iteration ended: time it, and end the trial after its last measured step."""
        self._forwards = 0
        self._micro_steps.clear()
        now = time.perf_counter()
        self._steps += 1
        if self._steps > self.warmup:
            self._durations.append(now - self._last)
        elif self._steps == self.warmup:
            self.meter.reset_peak()
        self._last = now
        if self._writes_progress:
            write_json(self.trial_dir / PROGRESS_FILE, {"steps": self._steps})
        if self._steps == self.warmup + self.measured:
            self._finish()

    def _max_over_ranks(self, values: list[float]) -> list[float]:
        tensor = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
        return tensor.tolist()

    def _not_finite(self) -> float:
        """1.0 where a trained parameter of this rank's part of the model holds NaN or inf,
        else 0.0 (a frozen one may hold an infinity on purpose, a mask's)."""
        if self._model is None:
            return 0.0
        with torch.no_grad():
            trained = (p for p in self._model.parameters() if p.requires_grad)
            return float(any(not p.isfinite().all() for p in trained))

    def _finish(self) -> None:
        local_peak = self.meter.peak_bytes()
        durations = self._max_over_ranks(self._durations)
        peak, activation, checkpointed, not_finite = self._max_over_ranks(
            [
                float(local_peak),
                float(self._activation_bytes),
                float(self._checkpointed_bytes),
                self._not_finite(),
            ]
        )
        if not_finite:
            # Measured, but not training: a configuration whose loss diverged (a larger batch
            # at the script's learning rate, bf16's precision) is no candidate, however fast.
            raise DivergedError(
                "distune trial: the model's parameters hold NaN or inf after the trial's "
                f"{self.warmup + self.measured} steps (checked on every rank): this "
                "configuration does not train, so it is not measured as one that does; check "
                "the script's loss at this micro-batch, accumulation and precision"
            )
        step = statistics.median(durations)
        rates = sorted(self.samples_per_step / d for d in durations)
        quartiles = statistics.quantiles(rates, n=4) if len(rates) >= 2 else [rates[0]] * 3
        write_rank_outcome(self.trial_dir, self.rank, "ok", peak_memory_bytes=local_peak)
        if self.rank == 0:
            result = {
                "outcome": "ok",
                "throughput": self.samples_per_step / step,
                "throughput_spread": (quartiles[2] - quartiles[0]) / (self.samples_per_step / step),
                "step_seconds": step,
                "step_seconds_all": durations,
                "peak_memory_bytes": int(peak),
                "activation_bytes_per_sample": int(activation / self.micro_batch),
                "checkpointed_activation_bytes_per_sample": int(checkpointed / self.micro_batch),
                "batch_dimensions": self.batch_dimensions,
                **self._description(),
            }
            write_json(self.trial_dir / RESULT_FILE, result)
        dist.barrier()
        dist.destroy_process_group()
        sys.stdout.flush()
        sys.stderr.flush()
        # The trial is over: the script's remaining loop must not run (see examples/job.py on
        # why a rank ends without finalizing the interpreter).
        os._exit(0)


def batch_norms(module: nn.Module) -> int:
    """How many batch norms ``module`` holds: their statistics are over each micro-batch, so a
    trial at another micro-batch trains with other statistics (level 2 says so)."""
    return sum(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in module.modules())


def wrapped_model_facts(module: nn.Module) -> dict[str, int]:
    """The sizes a trial reports of a model wrapped in distune's DDP without ``prepare``."""
    params = list(module.parameters())
    return {
        "parameter_bytes": sum(p.numel() * p.element_size() for p in params),
        "gradient_bytes": sum(p.numel() * p.element_size() for p in params if p.requires_grad),
        # Only DDP without checkpointing is tried: no block or optimizer share is needed,
        # and the optimizer (which the wrapper never sees) is in the profile's residual.
        "largest_block_bytes": 0,
        "optimizer_state_bytes": 0,
        "batch_norms": batch_norms(module),
    }


def _first_batched_tensor(inputs: Any) -> torch.Tensor | None:
    """The first tensor of a forward's inputs (any nesting) with a dimension to hold a batch."""
    return next(
        (t for t in tree_leaves(inputs) if isinstance(t, torch.Tensor) and t.dim() > 0), None
    )


def _batch_sizes(inputs: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[int, ...]:
    """What a forward's batch size may be, the usual reading first: the first input tensor's
    first dimension; then its other dimensions (a sequence-first model, an LSTM or a
    ``batch_first=False`` transformer, takes ``(time, batch, ...)``) and the length of a list
    of tensors given as an argument (a detection model takes a list of images)."""
    first = _first_batched_tensor((inputs, kwargs))
    if first is None:
        return ()
    lists = [
        len(arg)
        for arg in (*inputs, *kwargs.values())
        if isinstance(arg, (list, tuple)) and arg and all(isinstance(t, torch.Tensor) for t in arg)
    ]
    return (*first.shape, *lists)


class WrapperMeasurement(TrialMeasurement):
    """A trial measured through ``distune.DistributedDataParallel`` (no ``distune.prepare``).

    A step ends with each synchronised backward. The micro-batch is the batch size of the
    wrapper's forwards (where the launcher told it, any dimension of the input that holds it;
    else the first input tensor's first), the accumulation steps the forwards of a step;
    where the launcher set them (through ``arg_mappings``), a script
    that runs something else ends the trial as a crash saying so, rather than be measured as
    what it is not.
    """

    def __init__(
        self,
        trial_dir: Path,
        meter: MemoryMeter,
        settings: TrialSettings,
        module: nn.Module,
        device: torch.device,
    ) -> None:
        params = list(module.parameters())
        self._facts = wrapped_model_facts(module)
        super().__init__(
            trial_dir,
            meter,
            samples_per_step=0,
            micro_batch=0,
            warmup=settings.warmup_steps,
            measured=settings.measured_steps,
            device=device,
            describe=self._describe_wrapper,
        )
        self._check_micro_batch = False  # learned from the forwards, and checked there
        self._settings = settings
        self._params = params
        #: What the first training forward's batch size may be (``_batch_sizes``).
        self._forward_sizes: tuple[int, ...] | None = None
        self.accumulation = 0

    def attach_wrapper(self, wrapper: nn.Module, reducer: Reducer) -> None:
        """Count ``wrapper``'s forwards and end a step with each synchronised backward."""
        wrapper.register_forward_pre_hook(self._learn_samples, with_kwargs=True)
        self._watch(wrapper, ())
        previous = reducer.on_iteration

        def on_iteration(iterations: int) -> Any:
            self._after_step()
            return None if previous is None else previous(iterations)

        reducer.on_iteration = on_iteration

    def _learn_samples(self, module: nn.Module, inputs: tuple[Any, ...], kwargs: Any) -> None:
        if torch.is_grad_enabled() and module.training and self._forward_sizes is None:
            self._forward_sizes = _batch_sizes(inputs, kwargs)

    def _check_step(self) -> None:
        if self._steps == 0:
            self._learn_step()
        elif self._forwards != self.accumulation:
            raise TrialStepError(
                f"distune trial: this optimizer step ran {self._forwards} forward(s), the first "
                f"ran {self.accumulation}: the steps of a trial must be alike"
            )

    def _learn_step(self) -> None:
        sizes = self._forward_sizes
        if not sizes:
            raise TrialStepError(
                "distune trial: no tensor among the model's inputs tells the batch size; "
                "use distune.prepare, which is told the micro-batch"
            )
        wanted = self._settings.micro_batch
        accumulation = self._settings.accumulation
        # Told the micro-batch (a trial's, or the script's own flag in the profile), any
        # dimension of the input may hold it; untold, the first is read.
        micro = wanted if wanted in sizes else sizes[0]
        self.batch_dimensions = [i for i, size in enumerate(sizes) if size == micro]
        if wanted is not None and micro != wanted:
            raise TrialStepError(
                f"distune trial: train_micro_batch_size_per_gpu={wanted} ({MICRO_BATCH}), but "
                f"the script's forwards take "
                f"{micro} samples: does its config's arg_mappings name the flag that sets "
                "the batch size per forward?"
            )
        if accumulation is not None and self._forwards != accumulation:
            raise TrialStepError(
                f"distune trial: gradient_accumulation_steps={accumulation}, but the script ran "
                f"{self._forwards} forward(s) per synchronised backward: does arg_mappings "
                "name its accumulation flag, and does it accumulate under no_sync()?"
            )
        self.micro_batch = micro
        self.accumulation = self._forwards
        self.samples_per_step = micro * self._forwards * dist.get_world_size()
        if isinstance(self.meter, LiveTensorBytes):
            # The gradient buckets were made before the count began: count them now.
            self.meter.track(p.grad for p in self._params if p.grad is not None)

    def _describe_wrapper(self) -> dict[str, Any]:
        return {
            "api": WRAPPER,
            "config": {
                "micro_batch": self.micro_batch,
                "accumulation": self.accumulation,
                "stage": 0,
                "checkpointing": False,
            },
            "world_size": dist.get_world_size(),
            # Where the micro-batch is in the input (``_batch_sizes``' order): a later trial
            # that finds it only elsewhere shows the profile read another dimension.
            "batch_dimensions": self.batch_dimensions,
            **self._facts,
        }


def measure_wrapper_in_trial(wrapper: nn.Module, module: nn.Module, reducer: Reducer) -> None:
    """Called by every ``distune.DistributedDataParallel`` it builds. Inside a level-2 trial
    (``DISTUNE_TRIAL_DIR``) of a script that did not go through ``distune.prepare``, measure
    its steps through the wrapper, capped, and report as a prepared trial does; outside one,
    only apply the device memory cap if the launcher set one. Only the process's first model
    is measured so (a later model's steps are counted in the first's); every model's tensors
    are counted in the memory, and its sizes in the trial's."""
    if _PREPARING.get():
        return
    settings = TrialSettings.from_env()
    if not settings.is_trial and settings.device_memory is None:
        return
    device = next(module.parameters()).device
    tensors = [*module.parameters(), *module.buffers()]
    meter, earlier = process_meter(device, settings.device_memory, tensors)
    if settings.trial_dir is None:
        return
    if earlier is not None:
        facts = wrapped_model_facts(module)
        earlier.add_model(lambda: facts)
        return
    install_failure_report(settings.trial_dir, dist.get_rank())
    measurement = WrapperMeasurement(settings.trial_dir, meter, settings, module, device)
    measurement.attach_wrapper(wrapper, reducer)
    measures_trial(measurement)
