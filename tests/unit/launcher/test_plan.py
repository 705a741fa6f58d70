"""What distune-run decides to start: service or not, where, with which settings."""

import socket

import pytest

from distune.launcher.main import main
from distune.launcher.options import OptionError, parse
from distune.launcher.placement import is_local_address, is_wildcard_address, rendezvous_wait
from distune.launcher.plan import (
    UNSHARED_STORE,
    drop_trial_variables,
    plan_launch,
    restart_caveat,
    take_over_environment,
)
from distune.worker_settings import WorkerSettings
from tests.support.local_host import free_port_pair


def plan(*argv, env=None, monkeypatch=None):
    """The plan of ``argv``, on two ranks unless it says otherwise (one rank is not tuned)."""
    ranks = [] if "--nproc_per_node" in argv else ["--nproc_per_node", "2"]
    args, options = parse([*ranks, *argv, "train.py"])
    return plan_launch(args, options)


@pytest.fixture(autouse=True)
def no_token(monkeypatch):
    monkeypatch.delenv("DISTUNE_SERVICE_TOKEN", raising=False)
    monkeypatch.delenv("DISTUNE_SERVICE_TOKEN_FILE", raising=False)


def test_level_0_starts_no_service_and_tells_workers_not_to_tune():
    launch = plan("--nproc_per_node", "2")
    assert launch.placement is None
    assert not launch.starts_service
    assert launch.settings == WorkerSettings(autotune_level=0)
    assert not launch.settings.tuning


def test_single_node_level_1_hosts_service_on_loopback_free_port_with_random_token():
    launch = plan("--nproc_per_node", "2", "--autotune_level", "1")
    assert launch.starts_service
    assert (launch.placement.host, launch.placement.port) == ("127.0.0.1", 0)
    assert launch.service_args[:6] == (
        "--host",
        "127.0.0.1",
        "--port",
        "0",
        "--log-level",
        "warning",
    )
    assert launch.token and len(launch.token) >= 32
    assert launch.token not in " ".join(launch.service_args)
    assert launch.settings.service_token == launch.token
    other = plan("--nproc_per_node", "2", "--autotune_level", "1")
    assert other.token != launch.token
    assert launch.token_made_here  # handed over in a file: the user cannot know it


def test_service_arguments_carry_the_tuning_settings(tmp_path):
    launch = plan(
        "--autotune_level", "1",
        "--autotune_max_samples", "7",
        "--autotune_sampling_confidence_time", "2",
        "--autotune_warmup_time", "1.5",
        "--autotune_log_file", str(tmp_path / "a.log"),
        "--autotune_best_file", str(tmp_path / "best.json"),
        "--default_bucket_size", str(2**20),
    )  # fmt: skip
    argv = " ".join(launch.service_args)
    assert "--max-samples 7" in argv
    assert "--sampling-confidence-time 2.0" in argv
    assert "--warmup-time 1.5" in argv
    assert f"--log-file {tmp_path / 'a.log'}" in argv
    assert f"--best-file {tmp_path / 'best.json'}" in argv
    assert f"--default-bucket-size {2**20}" in argv
    assert "--fixed" not in argv
    assert launch.settings.default_bucket_size == 2**20


def test_output_log_goes_to_tmp_with_a_name_the_service_picks():
    argv = " ".join(plan("--autotune_level", "1", "--is_output_autotune_log").service_args)
    assert "--log-dir /tmp" in argv


def test_every_knob_fixed_means_no_service():
    single = plan("--nproc_per_node", "2", "--autotune_level", "1", "--bucket_size", "65536")
    assert single.placement is None
    assert single.settings.bucket_size == 65536
    multi = plan(
        "--nnodes", "2", "--nproc_per_node", "2", "--autotune_level", "1",
        "--bucket_size", "65536", "--hierarchical_reduce",
    )  # fmt: skip
    assert multi.placement is None
    assert multi.settings.hierarchical_reduce is True


def test_one_rank_is_not_tuned(monkeypatch):
    # One rank exchanges no gradients: a 1-rank level-1 run sampled 5 groups on noise and
    # reported "+129.0% +- 550.1% (within the noise)". Workers keep level 1 without a service.
    for ranks in (("--nproc_per_node", "1"), ("--nproc_per_node", "1", "--nnodes", "1:1")):
        launch = plan(*ranks, "--autotune_level", "1")
        assert launch.placement is None
        assert launch.settings == WorkerSettings(autotune_level=1)
        assert not launch.settings.tuning
    # An elastic job that may grow to two nodes is tuned as it runs.
    monkeypatch.setenv("DISTUNE_SERVICE_TOKEN", "s3cret")
    elastic = plan(
        "--nproc_per_node", "1", "--nnodes", "1:2", "--autotune_level", "1",
        "--rdzv_backend", "c10d", "--rdzv_endpoint", "127.0.0.1:29400",
    )  # fmt: skip
    assert elastic.starts_service


def test_worker_variables_in_the_launchers_environment_are_the_launchers_to_set():
    # A DISTUNE_SERVICE_URL exported for `distune status` sent the workers of a job that starts
    # no service to that address ("cannot be reached ... retrying"); a DISTUNE_BUCKET_SIZE
    # left from a torchrun run pinned 1 KiB buckets while the service tuned (each answer
    # "outside the model's search space"); DISTUNE_AUTOTUNE_LEVEL=1 silently ran level 0.
    environ = {
        "DISTUNE_SERVICE_URL": "http://127.0.0.1:9",
        "DISTUNE_SERVICE_TOKEN": "old",
        "DISTUNE_BUCKET_SIZE": "1024",
        "DISTUNE_AUTOTUNE_LEVEL": "1",
        "DISTUNE_SYNC_INTERVAL": "0.5",
        "PATH": "/bin",
    }
    pinned = plan("--autotune_level", "1", "--bucket_size", "65536")
    warnings = take_over_environment(pinned.settings, environ)
    assert "DISTUNE_SERVICE_URL" not in environ and "DISTUNE_SERVICE_TOKEN" not in environ
    # What the workers read once the launcher adds its settings: its own, nothing else.
    assert WorkerSettings.from_env({**environ, **pinned.settings.to_env()}) == pinned.settings
    assert environ["PATH"] == "/bin"
    assert warnings == [
        "DISTUNE_BUCKET_SIZE=1024 in the environment does not reach the workers: distune-run "
        "sets their DISTUNE_* variables from its own flags; use --bucket_size"
    ]
    environ = {"DISTUNE_AUTOTUNE_LEVEL": "1", "DISTUNE_BUCKET_SIZE": "65536"}
    (warning,) = take_over_environment(plan("--bucket_size", "65536").settings, environ)
    assert warning.startswith("DISTUNE_AUTOTUNE_LEVEL=1 in the environment does not reach")
    assert warning.endswith("use --autotune_level")


def test_level_2_variables_in_the_launchers_environment_are_dropped():
    environ = {"DISTUNE_TRIAL_DIR": "/tmp/t", "DISTUNE_MICRO_BATCH": "3", "PATH": "/bin"}
    warnings = drop_trial_variables(environ)
    assert environ == {"PATH": "/bin"}
    assert warnings == [
        "DISTUNE_MICRO_BATCH=3 in the environment does not reach the workers: distune-run sets "
        "their DISTUNE_* variables from its own flags and config; use "
        "train_micro_batch_size_per_gpu in --autotune_config",
        "DISTUNE_TRIAL_DIR=/tmp/t in the environment does not reach the workers: distune-run "
        "sets their DISTUNE_* variables from its own flags and config; it is set for the ranks "
        "of a level-2 trial, which distune-run starts itself",
    ]


def test_multi_node_bucket_fixed_still_tunes_hierarchical(monkeypatch):
    monkeypatch.setenv("DISTUNE_SERVICE_TOKEN", "s3cret")
    launch = plan(
        "--nnodes", "2", "--nproc_per_node", "2", "--autotune_level", "1",
        "--bucket_size", str(3 * 2**20), "--master_addr", "127.0.0.1",
    )  # fmt: skip
    assert launch.starts_service
    # 3 MiB rounds to 2^22, the nearest power of two in log scale; workers get the bytes.
    assert "--fixed bucket_size_2p=22" in " ".join(launch.service_args)
    assert launch.settings.bucket_size == 3 * 2**20


def test_multi_node_needs_a_shared_token():
    with pytest.raises(OptionError, match="multi-node tuning needs DISTUNE_SERVICE_TOKEN"):
        plan("--nnodes", "2", "--nproc_per_node", "2", "--autotune_level", "1")


def test_multi_node_static_node_0_hosts_at_master_addr_port_plus_one(monkeypatch):
    monkeypatch.setenv("DISTUNE_SERVICE_TOKEN", "s3cret")
    common = ("--nnodes", "2", "--nproc_per_node", "2", "--autotune_level", "1")
    node0 = plan(
        *common, "--node_rank", "0", "--master_addr", "127.0.0.1", "--master_port", "29600"
    )
    node1 = plan(
        *common, "--node_rank", "1", "--master_addr", "127.0.0.1", "--master_port", "29600"
    )
    assert node0.starts_service and not node1.starts_service
    assert node0.settings.service_url == node1.settings.service_url == "http://127.0.0.1:29601"
    assert node0.service_args[:4] == ("--host", "127.0.0.1", "--port", "29601")
    assert node1.service_args == ()
    assert node0.settings.service_token == node1.settings.service_token == "s3cret"


def test_multi_node_service_addr_and_port(monkeypatch):
    monkeypatch.setenv("DISTUNE_SERVICE_TOKEN", "s3cret")
    launch = plan(
        "--nnodes", "2", "--autotune_level", "1", "--node_rank", "1",
        "--autotune_service_addr", "http://10.9.8.7:31000",
    )  # fmt: skip
    assert not launch.starts_service
    assert launch.settings.service_url == "http://10.9.8.7:31000"
    with pytest.raises(OptionError, match="contradicts"):
        plan(
            "--nnodes", "2", "--autotune_level", "1",
            "--autotune_service_addr", "http://10.9.8.7:31000", "--autotune_service_port", "5",
        )  # fmt: skip
    with pytest.raises(OptionError, match="works for a single node only"):
        plan("--nnodes", "2", "--autotune_level", "1", "--autotune_service_port", "0")


def test_multi_node_c10d_host_is_the_endpoint_owner(monkeypatch):
    monkeypatch.setenv("DISTUNE_SERVICE_TOKEN", "s3cret")
    common = ("--nnodes", "2", "--autotune_level", "1", "--rdzv_backend", "c10d")
    here = plan(*common, "--rdzv_endpoint", "127.0.0.1:29400")
    assert here.starts_service
    assert here.settings.service_url == "http://127.0.0.1:29401"
    elsewhere = plan(*common, "--rdzv_endpoint", "192.0.2.10:29400")  # TEST-NET: not ours
    assert not elsewhere.starts_service
    assert elsewhere.settings.service_url == "http://192.0.2.10:29401"


def test_multi_node_c10d_is_host_decides_where_nodes_share_a_machine(monkeypatch):
    monkeypatch.setenv("DISTUNE_SERVICE_TOKEN", "s3cret")
    common = (
        "--nnodes", "2", "--autotune_level", "1", "--rdzv_backend", "c10d",
        "--rdzv_endpoint", "127.0.0.1:29400",
    )  # fmt: skip
    host = plan(*common, "--rdzv_conf", "is_host=1")
    guest = plan(*common, "--rdzv_conf", "join_timeout=60,is_host=false")
    assert host.starts_service and not guest.starts_service
    assert host.settings.service_url == guest.settings.service_url == "http://127.0.0.1:29401"
    with pytest.raises(OptionError, match="--rdzv_conf 'is_host=maybe'"):
        plan(*common, "--rdzv_conf", "is_host=maybe")


def test_a_service_port_that_is_the_rendezvous_stores_is_refused(monkeypatch):
    # The service started first and torch's store failed on EADDRINUSE with a traceback.
    monkeypatch.setenv("DISTUNE_SERVICE_TOKEN", "s3cret")
    level = ("--autotune_level", "1")
    refused = {
        ("--master_port", "29555", "--autotune_service_port", "29555"): "--master_port",
        ("--rdzv_backend", "c10d", "--rdzv_endpoint", "127.0.0.1:29555",
         "--autotune_service_port", "29555"): "--rdzv_endpoint",
        ("--nnodes", "2", "--master_addr", "127.0.0.1", "--autotune_service_addr",
         "http://localhost:29500"): "torch's default --master_port",
    }  # fmt: skip
    for flags, source in refused.items():
        with pytest.raises(OptionError, match=rf"port \d+ is the rendezvous store's \({source}\)"):
            plan(*flags, *level)
    for flags in (
        ("--autotune_service_port", "29500"),  # one node: torch picks a free store port
        ("--standalone", "--autotune_service_port", "29400"),
        ("--rdzv_backend", "c10d", "--rdzv_endpoint", "localhost:0"),  # both pick free ports
        ("--nnodes", "2", "--node_rank", "1", "--master_addr", "127.0.0.1",
         "--master_port", "29555", "--autotune_service_addr", "http://192.0.2.10:29555"),
    ):  # fmt: skip
        assert plan(*flags, *level).placement is not None


def test_single_node_service_addr_must_be_local():
    with pytest.raises(OptionError, match="must be one of this machine's"):
        plan("--autotune_level", "1", "--autotune_service_addr", "http://192.0.2.10:31000")


def test_local_addresses():
    assert is_local_address("127.0.0.1")
    assert is_local_address("localhost")
    assert not is_local_address("192.0.2.10")
    assert not is_local_address("no-such-host.invalid")


def test_sync_interval_passes_from_the_launcher_environment(monkeypatch):
    monkeypatch.setenv("DISTUNE_SYNC_INTERVAL", "0.25")
    assert plan("--autotune_level", "1").settings.sync_interval == 0.25
    monkeypatch.setenv("DISTUNE_SYNC_INTERVAL", "soon")
    with pytest.raises(OptionError, match="DISTUNE_SYNC_INTERVAL must be a number"):
        plan("--autotune_level", "1")


MULTI = ("--nnodes", "2", "--nproc_per_node", "2", "--autotune_level", "1")


def test_wildcard_addresses():
    for wildcard in ("0.0.0.0", "0", "::", "0:0::0"):
        assert is_wildcard_address(wildcard), wildcard
    for address in ("127.0.0.1", "::1", "localhost", "no-such-host.invalid"):
        assert not is_wildcard_address(address), address


@pytest.mark.parametrize("url", ["http://0.0.0.0:31000", "http://0:31000", "http://[::]:31000"])
def test_a_wildcard_service_url_is_refused_and_names_the_bind_flag(url, monkeypatch):
    with pytest.raises(OptionError, match=r"means every interface.*--autotune_service_bind"):
        plan("--autotune_level", "1", "--autotune_service_addr", url)
    monkeypatch.setenv("DISTUNE_SERVICE_TOKEN", "s3cret")
    with pytest.raises(OptionError, match=r"--autotune_service_addr .* means every interface"):
        plan(*MULTI, "--autotune_service_addr", url)


def test_a_wildcard_master_addr_is_refused_as_the_service_address(monkeypatch):
    monkeypatch.setenv("DISTUNE_SERVICE_TOKEN", "s3cret")
    with pytest.raises(OptionError, match=r"--master_addr 0\.0\.0\.0 .* means every interface"):
        plan(*MULTI, "--master_addr", "0.0.0.0")


def test_single_node_listens_on_every_interface_only_when_asked():
    launch = plan("--autotune_level", "1", "--autotune_service_bind", "0.0.0.0")
    assert launch.service_args[:2] == ("--host", "0.0.0.0")
    # The workers, on this machine, connect over loopback; the port is known once it listens.
    assert launch.with_service_port(4321).settings.service_url == "http://127.0.0.1:4321"
    ipv6 = plan("--autotune_level", "1", "--autotune_service_bind", "::")
    assert ipv6.service_args[:2] == ("--host", "::")
    assert ipv6.with_service_port(4321).settings.service_url == "http://[::1]:4321"
    with_url = plan(
        "--autotune_level", "1", "--autotune_service_bind", "0.0.0.0",
        "--autotune_service_addr", "http://127.0.0.1:31000",
    )  # fmt: skip
    assert with_url.service_args[:4] == ("--host", "0.0.0.0", "--port", "31000")
    assert with_url.settings.service_url == "http://127.0.0.1:31000"


def test_bind_address_must_be_this_machines_and_match_the_url():
    with pytest.raises(OptionError, match=r"--autotune_service_bind 192\.0\.2\.10: not an address"):
        plan("--autotune_level", "1", "--autotune_service_bind", "192.0.2.10")
    with pytest.raises(OptionError, match=r"listens on --autotune_service_bind 127\.0\.0\.1 only"):
        plan(
            "--autotune_level", "1", "--autotune_service_bind", "127.0.0.1",
            "--autotune_service_addr", "http://[::1]:31000",
        )  # fmt: skip


def test_multi_node_binds_the_url_address_unless_told(monkeypatch):
    monkeypatch.setenv("DISTUNE_SERVICE_TOKEN", "s3cret")
    node0 = ("--node_rank", "0", "--autotune_service_addr", "http://127.0.0.1:31000")
    default = plan(*MULTI, *node0)
    assert default.service_args[:4] == ("--host", "127.0.0.1", "--port", "31000")
    node0 = ("--node_rank", "0", "--autotune_service_addr", "http://10.9.8.7:31000")
    # Behind NAT: listen on every interface, while the other nodes use the public address.
    nat = plan(*MULTI, *node0, "--autotune_service_bind", "0.0.0.0")
    assert nat.service_args[:4] == ("--host", "0.0.0.0", "--port", "31000")
    assert nat.settings.service_url == "http://10.9.8.7:31000"
    other = plan(*MULTI, "--node_rank", "1", "--autotune_service_addr", "http://10.9.8.7:31000")
    assert other.service_args == ()


@pytest.mark.parametrize(
    ("flags", "source"),
    [
        (("--node_rank", "0", "--autotune_service_addr", "http://192.0.2.10:31000"),
         r"--autotune_service_addr http://192\.0\.2\.10:31000: 192\.0\.2\.10 is not an address"),
        (("--node_rank", "0", "--master_addr", "192.0.2.10"),
         r"--master_addr 192\.0\.2\.10 \(the service's default address\): 192\.0\.2\.10 is not"),
        (("--node_rank", "0", "--master_addr", "no-such-host.invalid"),
         r"no-such-host\.invalid does not resolve here"),
        (("--rdzv_backend", "c10d", "--rdzv_endpoint", "192.0.2.10:29400",
          "--rdzv_conf", "is_host=1"), r"--rdzv_endpoint 192\.0\.2\.10:29400 \(the service"),
    ],
)  # fmt: skip
def test_a_service_host_that_cannot_listen_at_its_address_is_refused_before_it_starts(
    flags, source, monkeypatch
):
    # It used to start the service and exit 1 on "Cannot assign requested address".
    monkeypatch.setenv("DISTUNE_SERVICE_TOKEN", "s3cret")
    with pytest.raises(OptionError, match=source) as refused:
        plan(*MULTI, *flags)
    assert "give one of this machine's addresses" in str(refused.value)
    assert "--autotune_service_bind" in str(refused.value)
    # Where the other nodes use another address (NAT), a local bind address serves it.
    assert plan(*MULTI, *flags, "--autotune_service_bind", "0.0.0.0").starts_service
    # A host name of this machine is one of its addresses.
    assert plan(*MULTI, "--node_rank", "0", "--master_addr", "localhost").starts_service


def test_a_node_says_what_it_waits_for_in_torchs_static_rendezvous():
    def wait(*argv):
        return rendezvous_wait(parse([*argv, "train.py"])[0])

    assert wait("--nnodes", "2", "--node_rank", "1", "--master_addr", "10.9.0.1") == (
        "node 1 of 2: waiting for the other nodes in torch's static rendezvous at "
        "10.9.0.1:29500 (up to 600 s; --rdzv_conf timeout=S changes it)"
    )
    timed = wait("--nnodes", "3", "--rdzv_endpoint", "h:7000", "--rdzv_conf", "timeout=30")
    assert timed is not None and "node 0 of 3" in timed and "at h:7000 (up to 30 s;" in timed
    assert wait("--nproc_per_node", "2") is None  # one node: nobody to wait for
    assert wait("--nnodes", "2", "--rdzv_backend", "c10d", "--rdzv_endpoint", "h:1") is None


def token_file(tmp_path, text="  file-token-123\n", mode=0o600):
    path = tmp_path / "token"
    path.write_text(text)
    path.chmod(mode)
    return path


def test_token_file_serves_a_multi_node_job(tmp_path, monkeypatch):
    monkeypatch.setenv("DISTUNE_SERVICE_TOKEN_FILE", str(token_file(tmp_path)))
    launch = plan(*MULTI, "--master_addr", "127.0.0.1")
    assert launch.token == launch.settings.service_token == "file-token-123"
    assert "file-token-123" not in " ".join(launch.service_args)
    # DISTUNE_SERVICE_TOKEN wins, as in the distune commands.
    monkeypatch.setenv("DISTUNE_SERVICE_TOKEN", "env-token")
    assert plan(*MULTI, "--master_addr", "127.0.0.1").token == "env-token"
    assert not launch.token_made_here  # the user's own: no file of it is written


@pytest.mark.parametrize(
    ("mode", "text", "message"),
    [
        (0o644, "t0ken\n", "readable by other users .*mode 0644.*chmod 600"),
        (0o640, "t0ken\n", "readable by other users"),
        (0o600, "\n", "is empty"),
        (0o600, "two words\n", "must be printable ASCII without spaces"),
    ],
)
def test_bad_token_files_are_refused(tmp_path, monkeypatch, mode, text, message):
    monkeypatch.setenv("DISTUNE_SERVICE_TOKEN_FILE", str(token_file(tmp_path, text, mode)))
    with pytest.raises(OptionError, match=f"DISTUNE_SERVICE_TOKEN_FILE.*{message}") as error:
        plan("--autotune_level", "1")
    assert "two words" not in str(error.value)  # a token is never echoed
    monkeypatch.setenv("DISTUNE_SERVICE_TOKEN_FILE", str(tmp_path / "missing"))
    with pytest.raises(OptionError, match="No such file"):
        plan("--autotune_level", "1")


@pytest.mark.parametrize(
    ("flags", "unshared", "warned"),
    [
        ([], None, False),
        (["--max_restarts", "1"], None, True),
        (["--max_restarts", "1"], "1", True),  # static: one store for every attempt
        (["--max_restarts", "1", "--rdzv_backend", "c10d"], None, True),
        (["--max_restarts", "1", "--rdzv_backend", "c10d"], "1", False),
        (["--max_restarts", "2", "--standalone"], "1", False),
    ],
)
def test_restarts_torch_may_break_are_warned_about(flags, unshared, warned, monkeypatch):
    if unshared is None:
        monkeypatch.delenv(UNSHARED_STORE, raising=False)
    else:
        monkeypatch.setenv(UNSHARED_STORE, unshared)
    args, _ = parse([*flags, "--nproc_per_node", "2", "train.py"])
    caveat = restart_caveat(args)
    assert (caveat is not None) == warned
    if warned:
        assert "--max_restarts" in caveat and f"{UNSHARED_STORE}=1" in caveat


def test_a_second_node_0_on_one_machine_is_told_its_service_port_is_taken(
    tmp_path, monkeypatch, capsys
):
    monkeypatch.setenv("DISTUNE_SERVICE_TOKEN", "a-token-of-this-job")
    script = tmp_path / "t.py"
    script.write_text("raise SystemExit(3)\n")
    rendezvous = free_port_pair()
    with socket.socket() as first_node_0:  # what the first launcher's service holds
        first_node_0.bind(("127.0.0.1", rendezvous + 1))
        first_node_0.listen()
        argv = ["--nnodes", "2", "--node_rank", "0", "--master_addr", "127.0.0.1",
                "--master_port", str(rendezvous), "--autotune_level", "1", str(script)]  # fmt: skip
        assert main(argv) == 1
    err = capsys.readouterr().err
    assert (
        f"port {rendezvous + 1} on 127.0.0.1 is in use by another program, or another launcher "
        "of this job started with --node_rank 0 on this machine" in err
    )
