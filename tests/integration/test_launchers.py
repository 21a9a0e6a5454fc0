"""Jobs started as Megatron jobs start: torchrun (one node and two), srun's variables, and compat.run in front.

* The demo under ``torchrun --nproc-per-node 4`` is one world of 4, reported once; under srun's
  variables (two processes started here as srun starts them) one world of 2.
* Megatron-LM's ``pretrain`` (scripts/examples/gpt/pretrain_gpt.py, unchanged between the runs,
  megatron-core 0.17.1's wheel) on two torchrun "nodes" of 2 processes each on this machine
  (c10d rendezvous): with ``-m compat.run`` in front, compat served every group and Megatron's
  own parallel_state module never ran, and the losses, gradient norms and every rank's final
  parameters are bit-identical to the same command without the runner.
* Launcher variables and sizes: parsed, and a size that is not the launcher's refused naming both,
  before any process group exists.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from scripts.examples import demo, launcher, train_gpt
from scripts.examples.gpt import pretrain_cli
from tests.support.paths import ROOT
from tests.support.releases.wheels import release_dir

TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]
_ALL_VARS = launcher.TORCHRUN_VARS + launcher.SLURM_VARS + launcher.RENDEZVOUS_VARS


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in _ALL_VARS}
    env.update(OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", **extra)
    return env


# ------------------------------------------------------------ variables and sizes


def test_launcher_variables():
    assert launcher.launched_world({}) is None
    assert launcher.launched_world({"RANK": "1", "WORLD_SIZE": "4"}) is None  # no LOCAL_RANK: not torchrun's
    assert launcher.launched_world({"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1"}) == launcher.LaunchedWorld(
        3, 4, 1, "torchrun"
    )
    slurm = {"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1"}
    assert launcher.launched_world(slurm) is None  # a batch script's own process: no rendezvous address
    world = launcher.launched_world({**slurm, "MASTER_ADDR": "node1", "MASTER_PORT": "6000"})
    assert world == launcher.LaunchedWorld(5, 8, 1, "srun") and world.size_source == "SLURM_NTASKS=8 from srun"
    both = {**slurm, "MASTER_ADDR": "a", "MASTER_PORT": "1", "RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0"}
    assert launcher.launched_world(both).launcher == "torchrun"  # torchrun inside an allocation


@pytest.mark.parametrize(
    "environ, message",
    [
        ({"RANK": "4", "WORLD_SIZE": "4", "LOCAL_RANK": "0"}, "RANK=4 is not a rank of a world of WORLD_SIZE=4"),
        ({"RANK": "x", "WORLD_SIZE": "4", "LOCAL_RANK": "0"}, "RANK='x' is not an integer"),
        ({"RANK": "0", "WORLD_SIZE": "-1", "LOCAL_RANK": "0"}, "WORLD_SIZE=-1 is negative"),
    ],
)
def test_bad_launcher_variables(environ, message):
    with pytest.raises(launcher.LauncherError, match=message):
        launcher.launched_world(environ)


def test_bind_device_without_cuda_is_refused_before_init():
    world = launcher.LaunchedWorld(0, 1, 0, "torchrun")
    with pytest.raises(launcher.LauncherError, match="--bind-device needs CUDA"):
        launcher.join(world, bind_device=True, use_cuda=False)


@pytest.fixture
def torchrun_of(monkeypatch):
    def world(size: int, rank: int = 0) -> None:
        for name in _ALL_VARS:
            monkeypatch.delenv(name, raising=False)
        monkeypatch.setenv("RANK", str(rank))
        monkeypatch.setenv("WORLD_SIZE", str(size))
        monkeypatch.setenv("LOCAL_RANK", str(rank))

    return world


def test_the_demo_refuses_a_layout_that_is_not_the_launchers_world(torchrun_of, capsys):
    torchrun_of(2)
    with pytest.raises(SystemExit) as exited:
        demo.main([])
    assert exited.value.code == 2
    assert (
        "the layout (tp*cp*dp*pp = 2*1*2*2) needs a world of 8 processes, but the launcher started 2 "
        "(WORLD_SIZE=2 from torchrun)" in capsys.readouterr().err
    )


def test_train_gpt_refuses_sizes_that_are_not_the_launchers_world(torchrun_of, capsys, monkeypatch):
    torchrun_of(8)
    monkeypatch.setattr(train_gpt, "run_launched", lambda *a: pytest.fail("started"))
    assert train_gpt.main(["--tp", "2", "--pp", "2"]) == 2
    assert (
        "tp * pp * dp = 2 * 2 * 1 needs a world of 4 processes, but the launcher started 8" in capsys.readouterr().err
    )
    started = []
    monkeypatch.setattr(pretrain_cli, "run_launched", lambda *a: started.append(a))
    assert train_gpt.main(["--loop", "training", "--nproc", "4"]) == 2
    assert "--nproc 4 is not the launcher's world of 8 processes" in capsys.readouterr().err
    assert not started
    run = pretrain_cli.parse_args(["--tensor-model-parallel-size", "2"], launched_size=8)
    assert run.nproc == 8  # Megatron takes dp from the world


# --------------------------------------------------------------- real launches


def _run_session(command: list[str], timeout: float) -> subprocess.CompletedProcess:
    """Run a launcher in a session of its own; past ``timeout`` the whole session is killed (the
    launcher's ranks too, which a kill of the launcher alone would orphan), then the timeout raised.
    """
    proc = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(), cwd=ROOT, start_new_session=True
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_session(proc)
        raise
    return subprocess.CompletedProcess(command, proc.returncode, out, err)


def _kill_session(proc: subprocess.Popen) -> None:
    """SIGKILL ``proc``'s session (it was started with ``start_new_session``) and reap ``proc``."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.communicate()


@pytest.mark.slow
@pytest.mark.multiprocess
def test_the_demo_under_torchrun_is_one_world_reported_once():
    done = _run_session(
        [*TORCHRUN, "--standalone", "--nproc-per-node", "4", "-m", "scripts.examples", "demo"]
        + ["--tp", "2", "--dp", "2", "--pp", "1", "--ep", "1"],
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    lines = done.stdout.splitlines()
    assert lines.count("parallel_state_ng demo: 4 processes started by torchrun, gloo on CPU") == 1, done.stdout
    assert lines.count("tensor + data parallel [tp-dp]: 1 group of 4") == 1
    assert lines[lines.index("tensor + data parallel [tp-dp]: 1 group of 4") + 1] == "  [0, 1, 2, 3]"
    assert sum(line.startswith("all 9 groups verified (5 kinds)") for line in lines) == 1


def _start_all(
    tmp_path: Path, name: str, commands: list[tuple[list[str], dict[str, str]]], timeout: float
) -> list[str]:
    """Run the commands at once (each its own process, output to a file); their outputs, all exit 0."""
    started = []
    try:
        for i, (command, env) in enumerate(commands):
            log = open(tmp_path / f"{name}-{i}.log", "w")  # noqa: SIM115  (closed below)
            started.append(
                (
                    log,
                    subprocess.Popen(
                        command, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT, start_new_session=True
                    ),
                )
            )
        codes = [proc.wait(timeout=timeout) for _, proc in started]
    finally:
        for log, proc in started:
            if proc.poll() is None:
                _kill_session(proc)
            log.close()
    outputs = [(tmp_path / f"{name}-{i}.log").read_text() for i in range(len(commands))]
    assert codes == [0] * len(commands), "".join(out[-4000:] for out in outputs)
    return outputs


@pytest.mark.slow
@pytest.mark.multiprocess
def test_the_demo_joins_the_world_srun_describes(tmp_path):
    port = str(_free_port())
    command = [sys.executable, "-m", "scripts.examples", "demo", "--tp", "2", "--pp", "1", "--dp", "1", "--ep", "1"]
    slurm = [
        _env(SLURM_PROCID=str(r), SLURM_NTASKS="2", SLURM_LOCALID=str(r), MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
        for r in range(2)
    ]
    outputs = _start_all(tmp_path, "srun", [(command, env) for env in slurm], timeout=300)
    assert outputs[0].splitlines()[0] == "parallel_state_ng demo: 2 processes started by srun, gloo on CPU"
    assert "all 2 groups verified" in outputs[0] and outputs[1] == ""


def _two_nodes(tmp_path: Path, name: str, program: list[str], env: dict[str, str], timeout: float = 600) -> list[dict]:
    """``program`` on two torchrun agents of 2 processes each (c10d rendezvous on a free port); the ranks' records."""
    records = tmp_path / name
    records.mkdir()
    env = dict(env, PSNG_PRETRAIN_RECORD=str(records))
    port = _free_port()
    command = [*TORCHRUN, "--nnodes", "2", "--nproc-per-node", "2", "--rdzv-backend", "c10d"]
    command += ["--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", f"psng-{name}-{port}"]
    # both "nodes" are this machine: say which one hosts the rendezvous store, rather than both trying
    nodes = [[*command, "--rdzv-conf", f"is_host={int(node == 0)}", *program] for node in range(2)]
    _start_all(tmp_path, name, [(node, env) for node in nodes], timeout)
    return [json.loads((records / f"rank-{r}.json").read_text()) for r in range(4)]


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.network
@pytest.mark.rotating(6, 10)  # end-to-end part 7 of 10 (docs/testing.md, "Rotating parts")
def test_megatron_pretrain_through_the_runner_on_two_torchrun_nodes_is_bit_identical(tmp_path):
    wheel = str(release_dir("0.17.1"))
    env = _env(PYTHONPATH=os.pathsep.join([wheel, str(ROOT)]))
    script = ["scripts/examples/gpt/pretrain_gpt.py", "--tensor-model-parallel-size", "2"]
    script += ["--pipeline-model-parallel-size", "2", "--train-iters", "2"]
    mcore = _two_nodes(tmp_path, "mcore", script, env)
    ours = _two_nodes(tmp_path, "runner", ["-m", "compat.run", *script], env)
    for records, module, own_run in (
        (mcore, "megatron.core.parallel_state", True),
        (ours, "compat.parallel_state", False),
    ):
        # one world of 4 from two agents of 2 processes
        assert [r["rank"] for r in records] == [0, 1, 2, 3] and {r["world_size"] for r in records} == {4}
        assert sorted(r["local_rank"] for r in records) == [0, 0, 1, 1]
        assert {r["parallel_state"] for r in records} == {module} == {r["training.mpu"] for r in records}
        assert all(r["version"] == "0.17.1" for r in records)
        # every group the model holds is one the module Megatron used holds; Megatron's own
        # module ran only without the runner
        assert all(r["groups"]["model"] > 0 and r["groups"]["not_served"] == 0 for r in records), records
        assert {r["groups"]["megatron_module_run"] for r in records} == {own_run}
    assert [r["iterations"] for r in ours] == [r["iterations"] for r in mcore]  # losses, grad norms: bit for bit
    assert [r["digest"] for r in ours] == [r["digest"] for r in mcore]
    losses = [it["losses"]["lm loss"] for r in mcore if r["last_stage"] for it in r["iterations"]]
    assert len(losses) == 4 and len(set(losses)) == 2  # two last-stage ranks, two iterations that differ


def _digest_and_losses(stdout: str) -> tuple[str, str]:
    lines = stdout.splitlines()
    digest = [line for line in lines if line.startswith("parameter digest: ")]
    losses = [line for line in lines if line.startswith("losses: ")]
    assert len(digest) == 1 and len(losses) == 1, stdout  # reported once
    return digest[0], losses[0]


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.rotating(8, 10)  # end-to-end part 9 of 10 (docs/testing.md, "Rotating parts")
def test_train_gpt_under_torchrun_trains_as_its_own_processes_do():
    options = ["-m", "scripts.examples", "train_gpt", "--tp", "2", "--pp", "2", "--steps", "2"]
    runs = [
        _run_session(command, timeout=600)
        for command in ([sys.executable, *options], [*TORCHRUN, "--standalone", "--nproc-per-node", "4", *options])
    ]
    assert all(run.returncode == 0 for run in runs), [run.stderr[-3000:] for run in runs]
    assert "4 processes started by torchrun: tp2 pp2 dp1" in runs[1].stdout
    assert _digest_and_losses(runs[1].stdout) == _digest_and_losses(runs[0].stdout)
