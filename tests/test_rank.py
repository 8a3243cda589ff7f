"""nbgpu.rank: job queries, device checks against simulated fleets, locks, memory limits.

Environments are passed as dicts (nothing patches os.environ). The expected CUDA texts
below are torch 2.13's, verified against c10/cuda/CUDAException.cpp and
CUDAMiscFunctions.cpp and a real torch 2.13 traceback (see rank.py). Two real torchrun
jobs of 2 ranks each (gloo on CPU) close the file: one that computes, one where rank 0
lands on a busy GPU (exclusive-process, held by a dead process).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
import uuid
from pathlib import Path

import psutil
import pytest
import torch

from nbgpu import rank as nr
from nbgpu.devices.sim.fleet import load_fleet
from nbgpu.errors import FleetSpecError, UserInputError

JOB = {
    "RANK": "3",
    "LOCAL_RANK": "1",
    "WORLD_SIZE": "8",
    "LOCAL_WORLD_SIZE": "2",
    "MASTER_ADDR": "127.0.0.1",
    "MASTER_PORT": "29555",
    "TORCHELASTIC_RUN_ID": "test",
}
BUSY_GPU0_GPU0 = load_fleet("busy-gpu0").gpus[0]
BUSY_GPU0_GPU1 = load_fleet("busy-gpu0").gpus[1]
TORCH_TAIL = (
    "For more detailed error information, run with CUDA_LOG_FILE=stderr\n"
    "Device-side assertion tracking was not enabled by user.\n"
)
BUSY_TEXT = (
    "CUDA error: CUDA-capable device(s) is/are busy or unavailable\n"
    "Search for `cudaErrorDevicesUnavailable' in "
    "https://docs.nvidia.com/cuda/cuda-runtime-api/group__CUDART__TYPES.html "
    "for more information.\n" + TORCH_TAIL
)
ORDINAL_TEXT = (
    "CUDA error: invalid device ordinal\n"
    "GPU device may be out of range, do you have enough GPUs?\n" + TORCH_TAIL
)


def job(**extra: str) -> dict[str, str]:
    return {**JOB, **extra}


# ------------------------------------------------------------------------ job queries


def test_job_queries_read_torchruns_variables():
    env = job()
    assert (nr.rank(env), nr.local_rank(env), nr.world_size(env)) == (3, 1, 8)
    assert nr.local_world_size(env) == 2
    assert nr.is_main(env) is False
    assert nr.is_main(job(RANK="0")) is True


@pytest.mark.parametrize("query", [nr.rank, nr.local_rank, nr.world_size, nr.local_world_size])
def test_outside_a_job_every_query_says_so_in_one_line(query):
    with pytest.raises(UserInputError) as info:
        query({"LOCAL_RANK": "0", "WORLD_SIZE": "2"})  # RANK is what decides
    assert str(info.value) == (
        "not inside a distributed job: RANK is unset (launch with %%torchrun N or torchrun)"
    )
    assert str(info.value) == nr.NOT_IN_JOB


def test_a_single_process_is_main_and_print0_prints(capsys):
    assert nr.is_main({}) is True
    nr.print0("hello", 42, sep="-", environ={})
    nr.print0("not me", environ=job(RANK="1"))
    nr.print0("me", environ=job(RANK="0"))
    assert capsys.readouterr().out == "hello-42\nme\n"


@pytest.mark.parametrize(("key", "value"), [("RANK", "zero"), ("LOCAL_RANK", "-1")])
def test_garbage_in_the_job_variables_is_named(key, value):
    with pytest.raises(UserInputError, match=f"{key}='{value}' is not a whole number"):
        nr.local_rank(job(**{key: value}))


def test_a_rank_without_local_rank_names_the_missing_variable():
    env = job()
    del env["LOCAL_RANK"]
    with pytest.raises(UserInputError, match="RANK is set but LOCAL_RANK is unset"):
        nr.local_rank(env)


# --------------------------------------------------------------------------- device()


def test_without_cuda_or_simulation_the_device_is_the_cpu(monkeypatch):
    # CUDA absent, explicitly: on a GPU machine torch would otherwise find one.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert nr.device(job()) == torch.device("cpu")
    assert nr.device({}) == torch.device("cpu")


def test_simulated_device_is_labelled_once_and_computes_on_cpu(capsys):
    env = job(LOCAL_RANK="2", NBGPU_SIMULATE="4xA40")
    assert nr.device(env) == torch.device("cpu")
    assert nr.device(env) == torch.device("cpu")
    err = capsys.readouterr().err
    label = "[nbgpu] simulated fleet '4xA40': cuda:2 -> GPU 2 (NVIDIA A40); computing on CPU\n"
    assert err == label


def test_simulated_busy_gpu_fails_with_torchs_exact_error_and_names_the_gpu():
    with pytest.raises(RuntimeError) as info:
        nr.device(job(LOCAL_RANK="0", NBGPU_SIMULATE="busy-gpu0"))
    error = info.value
    assert type(error) is torch.AcceleratorError  # what torch 2.13 raises from set_device
    assert error.error_code == 46
    assert str(error) == (
        BUSY_TEXT + f"[nbgpu] simulated fleet 'busy-gpu0': cuda:0 is physical GPU 0 "
        f"({BUSY_GPU0_GPU0.uuid}), exclusive-process, held by pid "
        f"{BUSY_GPU0_GPU0.processes[0].pid} (dead): see %gpu_doctor"
    )


def test_simulated_ordinal_beyond_the_visible_gpus_is_cudas_invalid_ordinal():
    with pytest.raises(RuntimeError) as info:
        nr.device(job(LOCAL_RANK="5", NBGPU_SIMULATE="busy-gpu0"))
    assert info.value.error_code == 101
    assert str(info.value).startswith("CUDA error: invalid device ordinal\n")
    assert str(info.value) == (
        ORDINAL_TEXT + "[nbgpu] simulated fleet 'busy-gpu0': local_rank 5 >= 4 visible devices "
        "(CUDA_VISIBLE_DEVICES unset): launch at most 4 ranks per node, e.g. %%torchrun 4"
    )


def test_simulation_follows_cuda_visible_devices(capsys):
    # Reordered: cuda:0 is now the healthy GPU 1, and cuda:1 the busy GPU 0.
    env = job(NBGPU_SIMULATE="busy-gpu0", CUDA_VISIBLE_DEVICES="1,0")
    assert nr.device({**env, "LOCAL_RANK": "0"}) == torch.device("cpu")
    assert "cuda:0 -> GPU 1 (NVIDIA A40)" in capsys.readouterr().err
    with pytest.raises(RuntimeError, match=r"cuda:1 is physical GPU 0 \(GPU-"):
        nr.device({**env, "LOCAL_RANK": "1"})
    with pytest.raises(RuntimeError, match=r"local_rank 1 >= 1 visible devices "):
        nr.device({**env, "LOCAL_RANK": "1", "CUDA_VISIBLE_DEVICES": "1"})


@pytest.mark.parametrize(
    ("fleet", "first_line", "explanation"),
    [
        ("gpu-lost", "CUDA error: unknown error", "is physical GPU 2 (GPU-"),
        ("4xA40,prohibited=2", BUSY_TEXT.splitlines()[0], "compute mode prohibited"),
    ],
)
def test_other_refusals_use_cudas_words_too(fleet, first_line, explanation):
    env = job(LOCAL_RANK="0", NBGPU_SIMULATE=fleet, CUDA_VISIBLE_DEVICES="2")
    with pytest.raises(RuntimeError) as info:
        nr.device(env)
    assert str(info.value).startswith(first_line + "\n")
    assert explanation in str(info.value).splitlines()[-1]


@pytest.mark.parametrize(
    ("fleet", "said"),
    [
        ("no-driver", "CUDA is unavailable (CUDA_ERROR_NO_DEVICE)"),
        ("no-library", "no CUDA driver (libcuda.so.1: cannot open shared object file"),
    ],
)
def test_a_simulated_box_without_cuda_computes_on_cpu_as_torch_would(fleet, said, capsys):
    assert nr.device(job(NBGPU_SIMULATE=fleet)) == torch.device("cpu")
    err = capsys.readouterr().err
    assert err.startswith(f"[nbgpu] simulated fleet '{fleet}': {said}")


def test_a_bad_fleet_is_a_one_line_user_error():
    with pytest.raises(FleetSpecError, match="NBGPU_SIMULATE='nonsense'"):
        nr.device(job(NBGPU_SIMULATE="nonsense"))


@pytest.fixture
def fake_cuda(monkeypatch):
    """torch.cuda answering as a 4-GPU box; set_device calls are recorded."""
    calls: list[int] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setattr(torch.cuda, "set_device", calls.append)
    return calls


def test_real_cuda_path_sets_the_local_device(fake_cuda):
    assert nr.device(job(LOCAL_RANK="2")) == torch.device("cuda", 2)
    assert fake_cuda == [2]


def test_real_cuda_path_refuses_an_ordinal_before_cuda_sees_it(fake_cuda):
    with pytest.raises(RuntimeError) as info:
        nr.device(job(LOCAL_RANK="5", CUDA_VISIBLE_DEVICES="0,1,2,3"))
    assert fake_cuda == []  # never reached torch.cuda.set_device
    assert str(info.value) == (
        ORDINAL_TEXT + "[nbgpu] local_rank 5 >= 4 visible devices "
        "(CUDA_VISIBLE_DEVICES=0,1,2,3): launch at most 4 ranks per node, e.g. %%torchrun 4"
    )


@pytest.mark.usefixtures("fake_cuda")
def test_real_cuda_errors_stay_torchs_own_with_a_note(monkeypatch):
    original = torch.AcceleratorError(BUSY_TEXT)

    def busy(_index: int) -> None:
        raise original

    monkeypatch.setattr(torch.cuda, "set_device", busy)
    with pytest.raises(torch.AcceleratorError) as info:
        nr.device(job(LOCAL_RANK="0"))
    assert info.value is original
    assert info.value.__notes__ == [
        "[nbgpu] cuda:0 (CUDA_VISIBLE_DEVICES unset) refused a CUDA context: see %gpu_doctor"
    ]


# -------------------------------------------------------------------- process group


def test_init_outside_a_job_says_so():
    with pytest.raises(UserInputError) as info:
        nr.init(environ={})
    assert str(info.value) == nr.NOT_IN_JOB


def test_init_needs_torchruns_rendezvous_address():
    env = job()
    del env["MASTER_PORT"]
    with pytest.raises(UserInputError, match="not launched by torchrun: MASTER_PORT is unset"):
        nr.init(backend="gloo", environ=env)


def test_init_refuses_nccl_without_cuda():
    with pytest.raises(UserInputError) as info:
        nr.init(backend="nccl", environ=job())
    assert str(info.value) == "backend nccl needs CUDA GPUs; on CPU use backend='gloo'"


@pytest.mark.parametrize("backend", ["ncl", "", "cpu:gloo,cuda:nccl2"])
def test_init_refuses_unknown_backends_by_name(backend):
    with pytest.raises(UserInputError, match=f"backend {backend!r} is not a torch.distributed"):
        nr.init(backend=backend, environ=job())


def test_init_refuses_a_non_positive_timeout():
    with pytest.raises(UserInputError, match="timeout_s=0"):
        nr.init(timeout_s=0, environ=job())


def test_collectives_in_a_single_process_are_trivial_and_destroy_is_safe():
    assert nr.all_reduce_sum(2.5, environ={}) == 2.5
    nr.barrier(environ={})
    nr.destroy()


def test_collectives_in_a_job_without_init_say_what_to_call():
    with pytest.raises(UserInputError, match=r"call nbgpu.rank.init\(\) first"):
        nr.all_reduce_sum(1.0, environ=job())
    with pytest.raises(UserInputError, match=r"call nbgpu.rank.init\(\) first"):
        nr.barrier(environ=job())


# ------------------------------------------------------------------------ the lock


def test_one_at_a_time_says_acquired_and_released_and_locks_in_the_run_dir(tmp_path, capsys):
    env = job(RANK="2", NBGPU_RUN_DIR=str(tmp_path))
    with nr.one_at_a_time("imports", environ=env):
        print("inside")
    err = capsys.readouterr().err.splitlines()
    assert [line.split(" after ")[0] for line in err] == [
        "[rank 2] LOCK: acquired 'imports'",
        "[rank 2] LOCK: released 'imports'",
    ]
    assert [p.name for p in tmp_path.iterdir()] == [f"imports.{os.uname().nodename}.lock"]


def test_one_at_a_time_without_a_run_dir_uses_a_private_dir_per_run():
    run_id = f"test-{uuid.uuid4().hex}"
    with nr.one_at_a_time("x", environ=job(TORCHELASTIC_RUN_ID=run_id)):
        pass
    directory = Path(tempfile.gettempdir()) / f"nbgpu-locks-{os.getuid()}" / run_id
    try:
        assert directory.is_dir()
        assert directory.parent.stat().st_mode & 0o777 == 0o700
        assert any(p.name.startswith("x.") for p in directory.iterdir())
    finally:
        for path in directory.iterdir():
            path.unlink()
        directory.rmdir()


def test_one_at_a_time_refuses_names_that_are_not_file_names():
    with (
        pytest.raises(UserInputError, match=r"lock name '../x'"),
        nr.one_at_a_time("../x", environ={}),
    ):
        pass


def test_one_at_a_time_waits_for_another_process(tmp_path, capsys):
    # A real second process holds the lock for a while; this one must wait for it.
    holder = textwrap.dedent(
        """
        import sys, time
        import nbgpu.rank as nr
        with nr.one_at_a_time("imports", environ={"RANK": "0", "NBGPU_RUN_DIR": sys.argv[1]}):
            print("held", flush=True)
            time.sleep(1.0)
            print(repr(time.time()), flush=True)
        """
    )
    argv = [sys.executable, "-c", holder, str(tmp_path)]
    with subprocess.Popen(argv, stdout=subprocess.PIPE, text=True) as child:
        try:
            assert child.stdout is not None
            assert child.stdout.readline() == "held\n"
            with nr.one_at_a_time("imports", environ=job(RANK="1", NBGPU_RUN_DIR=str(tmp_path))):
                entered = time.time()
            released_by_child = float(child.stdout.readline())
        finally:
            child.kill()
    assert entered >= released_by_child
    err = capsys.readouterr().err
    assert err.startswith("[rank 1] LOCK: waiting for 'imports'")
    assert "[rank 1] LOCK: acquired 'imports' after " in err


# ------------------------------------------------------------------ memory limit


@pytest.mark.parametrize(
    ("size", "expected"),
    [
        ("60G", 60 * 2**30),
        ("512M", 512 * 2**20),
        ("1.5GiB", 3 * 2**29),
        ("2 GB", 2 * 10**9),
        ("1t", 2**40),
        ("4096", 4096),
        (4096, 4096),
    ],
)
def test_parse_size_accepts_bytes_and_binary_suffixes(size, expected):
    assert nr.parse_size(size) == expected


@pytest.mark.parametrize("size", ["", "abc", "-1G", "0", "12X", "G", 0, -5, True, 1.5])
def test_parse_size_names_garbage_and_the_accepted_form(size):
    with pytest.raises(UserInputError) as info:
        nr.parse_size(size)
    assert repr(size) in str(info.value)
    assert "e.g. 80G, 80GiB, 80GB or 512M" in str(info.value)


def test_a_limit_below_the_current_address_space_is_refused_before_it_bites():
    with pytest.raises(UserInputError, match=r"'1M' \(0.00 GiB\) is below this rank's current"):
        nr.set_memory_limit("1M")


def test_set_memory_limit_caps_the_address_space_of_a_real_process():
    # In a child: a lowered limit would otherwise stay with the test process.
    script = textwrap.dedent(
        """
        import resource
        import nbgpu.rank as nr
        from nbgpu.profile.recorder import status_bytes
        vm = status_bytes("VmSize")
        limit = nr.set_memory_limit(vm + 256 * 2**20)
        assert resource.getrlimit(resource.RLIMIT_AS)[0] == limit
        try:
            blob = bytearray(1024 * 2**20)
        except MemoryError:
            print("capped")
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=False
    )
    assert (done.returncode, done.stdout, done.stderr) == (0, "capped\n", "")


def test_importing_the_module_stays_cheap():
    probe = (
        "import sys, nbgpu.rank; "
        "print(sorted(m for m in ('torch', 'IPython', 'pynvml', 'psutil', 'filelock') "
        "if m in sys.modules))"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, check=True
    )
    assert done.stdout == "[]\n"


# ---------------------------------------------------------- real torchrun jobs (slow)

RANK_SCRIPT = """
import os, sys, time
from pathlib import Path

import nbgpu.rank as nr

backend = os.environ.get("TEST_BACKEND") or None
nr.init(backend)
nr.init(backend)  # a second call is a no-op
device = nr.device()
total = nr.all_reduce_sum(nr.rank() + 1)
turns = Path(os.environ["NBGPU_RUN_DIR"]) / "turns.txt"
with nr.one_at_a_time("imports"):
    with turns.open("a") as fh:
        fh.write(f"enter {nr.rank()} {time.time()!r}\\n")
    time.sleep(0.5)
    with turns.open("a") as fh:
        fh.write(f"exit {nr.rank()} {time.time()!r}\\n")
nr.barrier()
nr.print0(f"SUM {total} WORLD {nr.world_size()}", flush=True)
print(f"DONE rank {nr.rank()} on {device}", flush=True)
nr.destroy()
"""


def _leftovers(marker: str) -> list[psutil.Process]:
    return [
        process
        for process in psutil.process_iter(["cmdline"])
        if marker in " ".join(process.info["cmdline"] or ())
    ]


def torchrun(tmp_path: Path, env: dict[str, str], timeout_s: float = 120) -> tuple[int, str]:
    """Run RANK_SCRIPT under real torchrun with 2 ranks; leave no process behind."""
    script = tmp_path / f"rank_script_{uuid.uuid4().hex}.py"
    script.write_text(RANK_SCRIPT, encoding="utf-8")
    run_env = {
        **env,
        "NBGPU_RUN_DIR": str(tmp_path),
        "OMP_NUM_THREADS": "1",  # torchrun warns and sets it otherwise
        "PYTHONUNBUFFERED": "1",
    }
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    argv += ["--nproc-per-node", "2", str(script)]
    agent = subprocess.Popen(
        argv,
        env=run_env,
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        output, _ = agent.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(agent.pid, signal.SIGKILL)
        output, _ = agent.communicate(timeout=30)
        pytest.fail(f"torchrun did not finish in {timeout_s} s:\n{output}")
    finally:
        # Workers run in their own sessions: find them by the script's unique name.
        stray = _leftovers(script.name)
        for process in stray:
            process.kill()
        psutil.wait_procs(stray, timeout=10)
    assert not stray, f"left behind: {[p.pid for p in stray]}"
    return agent.returncode, output


@pytest.mark.slow
def test_torchrun_job_on_a_simulated_fleet(tmp_path, sim_env):
    code, out = torchrun(tmp_path, {**sim_env, "NBGPU_SIMULATE": "4xA40", "TEST_BACKEND": "nccl"})
    assert code == 0, out
    assert "SUM 3.0 WORLD 2\n" in out  # 1 + 2, printed by rank 0 only, in one write
    assert out.count("SUM ") == 1
    assert "DONE rank 0 on cpu" in out
    assert "DONE rank 1 on cpu" in out
    for k in (0, 1):
        label = (
            f"[nbgpu] simulated fleet '4xA40': cuda:{k} -> GPU {k} (NVIDIA A40); computing on CPU"
        )
        assert out.count(label) == 1, out
    assert "backend 'nccl' runs as 'gloo' on CPU" in out
    # The lock: each rank's turn ends before the other's begins, in the shared stream...
    lock_lines = re.findall(r"\[rank (\d)\] LOCK: (acquired|released)", out)
    assert len(lock_lines) == 4, out
    assert [what for _, what in lock_lines] == ["acquired", "released"] * 2
    assert lock_lines[0][0] == lock_lines[1][0] != lock_lines[2][0] == lock_lines[3][0]
    # ...and by the clock, in the file both ranks wrote inside the block.
    turns = [line.split() for line in (tmp_path / "turns.txt").read_text().splitlines()]
    assert [kind for kind, _, _ in turns] == ["enter", "exit", "enter", "exit"]
    assert turns[0][1] == turns[1][1] != turns[2][1] == turns[3][1]
    assert float(turns[1][2]) <= float(turns[2][2])


@pytest.mark.slow
def test_torchrun_rank_on_a_busy_gpu_fails_with_cudas_message(tmp_path, sim_env):
    code, out = torchrun(tmp_path, {**sim_env, "NBGPU_SIMULATE": "busy-gpu0"})
    assert code != 0, out
    assert "torch.AcceleratorError: CUDA error: CUDA-capable device(s) is/are busy" in out, out
    assert "[nbgpu] simulated fleet 'busy-gpu0': cuda:0 is physical GPU 0 (GPU-" in out
    assert "exclusive-process, held by pid" in out
    assert "SUM " not in out
    # torchrun's own summary agrees: rank 0 failed first, with Python's exit code 1.
    assert re.search(r"Root Cause.*?rank\s*: 0 \(local_rank: 0\)\s+exitcode\s*: 1 ", out, re.S)
    assert not (tmp_path / "turns.txt").exists()  # rank 0 never got past init
