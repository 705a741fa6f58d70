"""What a ``distune-run`` will start, decided before anything starts.

From torchrun's flags and the autotune options, the plan says whether this job is tuned at all,
whether this node hosts the tuning service (and with which arguments), which token guards it,
and which ``DISTUNE_*`` settings the workers get. Every inconsistency is an
:class:`~distune.launcher.options.OptionError` raised here, so the launcher can refuse the job
with one line before a single process exists.
"""

from __future__ import annotations

import argparse
import os
import secrets
from collections.abc import MutableMapping
from dataclasses import dataclass, field, replace

from torch.distributed.run import parse_min_max_nnodes

from distune import trial_settings
from distune.launcher.options import AutotuneOptions, OptionError, local_world_size, one_rank
from distune.launcher.placement import ServicePlacement, place_service
from distune.service_auth import SERVICE_TOKEN_FILE, TokenError, token_from_environment
from distune.space import DEFAULT_BUCKET_SIZE, bucket_size_2p_for
from distune.worker_settings import (
    AUTOTUNE_LEVEL,
    BUCKET_SIZE,
    DEFAULT_BUCKET_SIZE_VAR,
    HIERARCHICAL_REDUCE,
    SERVICE_TOKEN,
    SYNC_INTERVAL,
    VARIABLES,
    SettingsError,
    WorkerSettings,
)

#: Where ``--is_output_autotune_log`` puts the log (with an unpredictable name), as Bagua does.
DEFAULT_LOG_DIR = "/tmp"


@dataclass(frozen=True)
class LaunchPlan:
    """The decisions of one launch; ``placement`` is None when no service is involved."""

    placement: ServicePlacement | None
    service_args: tuple[str, ...]
    token: str | None = field(repr=False)  # never in a log line
    settings: WorkerSettings
    #: The token is a random one made for this job (a single-node job given none): the user
    #: cannot know it, so the launcher hands it over in a file of theirs.
    token_made_here: bool = False

    @property
    def starts_service(self) -> bool:
        """Whether this launcher starts the tuning service."""
        return self.placement is not None and self.placement.hosted_here

    def for_run(self, autotune_level: int) -> LaunchPlan:
        """The plan of the training after level 2's trials: the same service, the workers
        tuning at ``autotune_level`` (0 where the winner's communication is FSDP's own)."""
        return replace(self, settings=replace(self.settings, autotune_level=autotune_level))

    def with_service_port(self, port: int) -> LaunchPlan:
        """The plan once the service is listening (a free port is known only then)."""
        assert self.placement is not None
        placement = replace(self.placement, port=port)
        return replace(
            self, placement=placement, settings=replace(self.settings, service_url=placement.url)
        )


def _sync_interval_from_environment() -> float:
    # No flag for this one: a DISTUNE_SYNC_INTERVAL in the launcher's environment passes on.
    try:
        return WorkerSettings.from_env(
            {SYNC_INTERVAL: os.environ.get(SYNC_INTERVAL, "")}
        ).sync_interval
    except SettingsError as error:
        raise OptionError(str(error)) from None


def _hierarchical_possible(args: argparse.Namespace) -> bool:
    _, max_nodes = parse_min_max_nnodes(args.nnodes)
    return max_nodes > 1 and not args.standalone and local_world_size(args) > 1


def _service_args(options: AutotuneOptions, placement: ServicePlacement) -> tuple[str, ...]:
    # The launcher prints progress itself (progress.py): the service's own lines would repeat it.
    argv = ["--host", placement.bind, "--port", str(placement.port), "--log-level", "warning"]
    if options.autotune_log_file is not None:
        argv += ["--log-file", str(options.autotune_log_file)]
    elif options.is_output_autotune_log:
        argv += ["--log-dir", DEFAULT_LOG_DIR]
    for name, value in options.service_values().items():
        argv += [f"--{name.replace('_', '-')}", str(value)]
    fixed = []
    if options.bucket_size is not None:
        fixed.append(f"bucket_size_2p={bucket_size_2p_for(options.bucket_size)}")
    if options.hierarchical_reduce is not None:
        fixed.append(f"is_hierarchical_reduce={str(options.hierarchical_reduce).lower()}")
    if fixed:
        argv += ["--fixed", *fixed]
    return tuple(argv)


#: The flag that sets each worker variable a user may have exported by hand.
_FLAG_OF = {
    AUTOTUNE_LEVEL: "--autotune_level",
    BUCKET_SIZE: "--bucket_size",
    HIERARCHICAL_REDUCE: "--[no-]hierarchical_reduce",
    DEFAULT_BUCKET_SIZE_VAR: "--default_bucket_size",
}


def take_over_environment(settings: WorkerSettings, environ: MutableMapping[str, str]) -> list[str]:
    """Remove from ``environ`` (the workers' inheritance) the ``DISTUNE_*`` worker variables
    ``settings`` leaves unset; the warnings for those a user set to what the workers will not
    get. The launcher alone tells workers how to tune: a ``DISTUNE_SERVICE_URL`` exported for
    ``distune status`` made the workers of a job that starts no service (one rank, every knob
    pinned) report to that old address, and a ``DISTUNE_BUCKET_SIZE`` left from a torchrun
    experiment pinned the workers' buckets while the service tuned them (every answer outside
    the pinned space: nothing tuned, the job on 1 KiB buckets). ``DISTUNE_SYNC_INTERVAL``
    passes on: the settings carry it."""
    given = settings.to_env()
    warnings = []
    for name in VARIABLES:
        value = environ.get(name)
        if value is None or given.get(name) == value:
            continue
        if name in _FLAG_OF:
            warnings.append(
                f"{name}={value} in the environment does not reach the workers: distune-run "
                f"sets their DISTUNE_* variables from its own flags; use {_FLAG_OF[name]}"
            )
        if name not in given:
            del environ[name]
    return warnings


#: Where each level-2 variable comes from, for a user who exported it by hand.
_SOURCE_OF_TRIAL_VARIABLE = {
    trial_settings.MICRO_BATCH: "use train_micro_batch_size_per_gpu in --autotune_config",
    trial_settings.ACCUMULATION: "use gradient_accumulation_steps in --autotune_config",
    trial_settings.ZERO_STAGE: "use zero_optimization.stage in --autotune_config",
    trial_settings.CHECKPOINTING: "use activation_checkpointing in --autotune_config",
    trial_settings.BF16: "use bf16 in --autotune_config",
    trial_settings.DEVICE_MEMORY: "use --autotune_device_memory",
}


def drop_trial_variables(environ: MutableMapping[str, str]) -> list[str]:
    """Remove level 2's ``DISTUNE_*`` variables from ``environ`` before the launcher sets its
    own (a trial's, the pins of a best_config.json); a warning for each one found. A
    ``DISTUNE_TRIAL_DIR`` left in a shell (from re-running a trial's command by hand) made
    every rank of an ordinary run a trial's: it wrote its result there and ended after seven
    steps with exit code 0, having printed nothing; a stale ``DISTUNE_MICRO_BATCH`` would
    silently change the batch of a script using ``distune.prepare``."""
    warnings = []
    for name in trial_settings.VARIABLES:
        value = environ.pop(name, None)
        if value is None:
            continue
        source = _SOURCE_OF_TRIAL_VARIABLE.get(
            name, "it is set for the ranks of a level-2 trial, which distune-run starts itself"
        )
        warnings.append(
            f"{name}={value} in the environment does not reach the workers: distune-run sets "
            f"their DISTUNE_* variables from its own flags and config; {source}"
        )
    return warnings


#: The setting with which torch's c10d rendezvous gives workers a store of their own.
UNSHARED_STORE = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"


def restart_caveat(args: argparse.Namespace) -> str | None:
    """A warning for a job whose restarts torch 2.13 may break, or None.

    With static rendezvous (torchrun's default) one store serves every attempt, and with c10d
    the workers share the agent's store unless told otherwise: either way a restarted worker
    can read its predecessor's address and fail to connect (pytorch/pytorch#135712). The
    launcher says so rather than change torchrun's defaults behind the user's back.
    """
    if args.max_restarts < 1:
        return None
    c10d = args.standalone or args.rdzv_backend == "c10d"
    if c10d and os.environ.get(UNSHARED_STORE) == "1":
        return None
    return (
        f"--max_restarts {args.max_restarts}: with torch's {'c10d' if c10d else 'static'} "
        "rendezvous as configured, restarted workers may be handed their predecessors' "
        f"addresses and fail to connect; for reliable restarts use --rdzv_backend c10d (or "
        f"--standalone) with {UNSHARED_STORE}=1 (pytorch/pytorch#135712)"
    )


def _job_token(multi_node: bool) -> tuple[str, bool]:
    """The token the user gave, or a random one for a single-node job; and whether it is a
    random one.

    A multi-node job needs the same token on every node, and its service listens on the network,
    so there a missing token is an error rather than something to make up.
    """
    try:
        token = token_from_environment(os.environ)
    except TokenError as error:
        raise OptionError(str(error)) from None
    if token is not None:
        return token, False
    if multi_node:
        raise OptionError(
            f"multi-node tuning needs {SERVICE_TOKEN} or {SERVICE_TOKEN_FILE} set to the same "
            "secret on every node (the service is reachable from the network)"
        )
    return secrets.token_urlsafe(32), True


def plan_trials(args: argparse.Namespace, options: AutotuneOptions) -> LaunchPlan:
    """Level 2: the service coordinates the trials, so it runs even where every level-1 knob
    is pinned (or the job has one rank); the workers' settings are level 1's
    (:meth:`LaunchPlan.for_run` sets the level the winner trains with)."""
    plan = plan_launch(args, replace(options, autotune_level=1))
    if plan.placement is not None:
        return plan
    placement = place_service(args, options)
    token, made_here = _job_token(placement.multi_node)
    return LaunchPlan(
        placement=placement,
        service_args=_service_args(options, placement) if placement.hosted_here else (),
        token=token,
        settings=replace(plan.settings, service_url=placement.url, service_token=token),
        token_made_here=made_here,
    )


def plan_launch(args: argparse.Namespace, options: AutotuneOptions) -> LaunchPlan:
    """Decide what to start; raises OptionError for settings that cannot work together."""
    settings = WorkerSettings(
        autotune_level=options.autotune_level,
        bucket_size=options.bucket_size,
        hierarchical_reduce=options.hierarchical_reduce,
        default_bucket_size=options.default_bucket_size or DEFAULT_BUCKET_SIZE,
        sync_interval=_sync_interval_from_environment(),
    )
    all_fixed = options.bucket_size is not None and (
        options.hierarchical_reduce is not None or not _hierarchical_possible(args)
    )
    if options.autotune_level == 0 or all_fixed or one_rank(args):
        # Nothing to tune: the workers run the fixed (or default) group and no service exists.
        return LaunchPlan(placement=None, service_args=(), token=None, settings=settings)

    placement = place_service(args, options)
    token, made_here = _job_token(placement.multi_node)
    settings = replace(settings, service_url=placement.url, service_token=token)
    service_args = _service_args(options, placement) if placement.hosted_here else ()
    return LaunchPlan(
        placement=placement,
        service_args=service_args,
        token=token,
        settings=settings,
        token_made_here=made_here,
    )
