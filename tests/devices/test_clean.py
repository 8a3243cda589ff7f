"""clean.py against real processes: what is listed, what is spared, what is signalled.

Every stand-in is a real process (orphans adopted by pid 1 or a subreaper, a zombie, a
SIGTERM-ignoring sleeper, a torchrun-like worker); each test proves with psutil that it
ran before and is gone (or still running) after. The ``spawn`` fixture kills them all.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from nbgpu.devices.clean import (
    CleanEntry,
    CleanPlan,
    execute_clean,
    plan_clean,
)
from nbgpu.devices.holders import (
    ContainerInfo,
    HolderInfo,
    describe_pid,
    device_file_holders,
    recorded_holder,
)
from nbgpu.errors import UserInputError
from tests.devices.test_holders import Spawner, clean_env, exited, free_pid, wait_for


@pytest.fixture
def spawn() -> Iterator[Spawner]:
    spawner = Spawner()
    try:
        yield spawner
    finally:
        spawner.cleanup()


def running(proc: psutil.Process) -> bool:
    return not exited(proc)


def only_candidate(plan: CleanPlan) -> CleanEntry:
    assert len(plan.candidates) == 1, plan.text()
    return plan.candidates[0]


def only_skipped(plan: CleanPlan) -> CleanEntry:
    assert not plan.candidates, plan.text()
    assert len(plan.skipped) == 1, plan.text()
    return plan.skipped[0]


# --------------------------------------------------------------------------- end to end


def test_orphans_of_this_user_are_listed_stopped_and_gone(spawn):
    sleeper = spawn.orphan("sleep 60")
    rank = spawn.orphan(
        "sleep 61", env=clean_env(TORCHELASTIC_RUN_ID="run-1", CUDA_VISIBLE_DEVICES="2,3")
    )
    plan = plan_clean({0: [describe_pid(sleeper.pid)], 2: [describe_pid(rank.pid)]})
    assert [c.holder.pid for c in plan.candidates] == sorted([sleeper.pid, rank.pid])
    by_pid = {c.holder.pid: c for c in plan.candidates}
    assert by_pid[sleeper.pid].gpus == (0,)
    assert by_pid[sleeper.pid].reason.startswith("orphaned (")
    assert by_pid[sleeper.pid].reason.endswith("holds GPU 0 with no live parent job")
    assert by_pid[rank.pid].gpus == (2,)
    assert by_pid[rank.pid].reason.startswith("orphaned torchrun rank (agent gone: ")
    assert by_pid[rank.pid].holder.visible_devices == "2,3"
    assert not plan.skipped

    assert running(sleeper)
    assert running(rank)
    report = execute_clean(plan, confirm=None, grace_s=2.0)
    assert report.confirmed
    assert not report.dry_run
    assert report.ok
    assert {o.pid: o.result for o in report.outcomes} == {
        sleeper.pid: "terminated",
        rank.pid: "terminated",
    }
    assert exited(sleeper)
    assert exited(rank)
    assert "terminated" in report.text()


def test_a_device_file_holder_without_a_gpu_is_found_and_stopped(spawn, tmp_path):
    device = tmp_path / "nvidia0"
    device.write_text("")
    orphan = spawn.orphan(f"sleep 60 3<{device}")
    files = device_file_holders(pattern=str(tmp_path))
    assert files == {orphan.pid: (str(device),)}
    # No HolderInfo given: plan_clean looks the pid up itself.
    candidate = only_candidate(plan_clean({}, files))
    assert candidate.holder.pid == orphan.pid
    assert candidate.gpus == ()
    assert candidate.device_files == (str(device),)
    assert f"holds {device} with no live parent job" in candidate.reason

    report = execute_clean(plan_clean({}, files), confirm=None, grace_s=2.0)
    assert [o.result for o in report.outcomes] == ["terminated"]
    assert exited(orphan)


def test_process_ignoring_sigterm_is_killed_after_the_grace(spawn):
    stubborn = spawn.orphan("sleep 60", setup="trap '' TERM;")
    # Prove the stand-in really ignores SIGTERM (bit 15 of SigIgn), inherited across exec.
    sig_ign = next(
        line.split()[1]
        for line in Path(f"/proc/{stubborn.pid}/status").read_text().splitlines()
        if line.startswith("SigIgn:")
    )
    assert int(sig_ign, 16) & (1 << (signal.SIGTERM - 1))
    plan = plan_clean({1: [describe_pid(stubborn.pid)]})
    start = time.monotonic()
    report = execute_clean(plan, confirm=None, grace_s=0.5)
    elapsed = time.monotonic() - start
    assert [o.result for o in report.outcomes] == ["killed"]
    assert exited(stubborn)
    assert 0.5 <= elapsed < 1.5


def test_stopped_orphan_is_terminated(spawn):
    orphan = spawn.orphan("sleep 60")
    orphan.send_signal(signal.SIGSTOP)
    wait_for(lambda: orphan.status() == psutil.STATUS_STOPPED, what="SIGSTOP")
    candidate = only_candidate(plan_clean({0: [describe_pid(orphan.pid)]}))
    assert candidate.holder.state == "stopped"
    report = execute_clean(CleanPlan((candidate,), ()), confirm=None, grace_s=2.0)
    assert [o.result for o in report.outcomes] == ["terminated"]
    assert exited(orphan)


# --------------------------------------------------------------------------- nothing signalled


def test_dry_run_signals_nothing(spawn):
    orphan = spawn.orphan("sleep 60")
    plan = plan_clean({0: [describe_pid(orphan.pid)]})
    assert len(plan.candidates) == 1

    def must_not_ask(_plan):
        raise AssertionError("a dry run asks nothing")

    report = execute_clean(plan, confirm=must_not_ask, dry_run=True, grace_s=0)
    assert report.outcomes == ()
    assert report.dry_run
    assert not report.confirmed
    time.sleep(0.2)  # a SIGTERM'd sleep dies within milliseconds
    assert running(orphan)
    assert "Dry run: nothing was signalled." in report.text()


def test_declined_confirmation_signals_nothing(spawn):
    orphan = spawn.orphan("sleep 60")
    plan = plan_clean({0: [describe_pid(orphan.pid)]})
    asked: list[CleanPlan] = []

    def decline(shown):
        asked.append(shown)
        assert running(orphan)  # asked before anything is signalled
        return False

    report = execute_clean(plan, confirm=decline, grace_s=0)
    assert asked == [plan]
    assert report.outcomes == ()
    assert not report.confirmed
    time.sleep(0.2)
    assert running(orphan)
    assert "Not confirmed: nothing was signalled." in report.text()


def test_accepted_confirmation_is_asked_once_then_stops(spawn):
    orphan = spawn.orphan("sleep 60")
    plan = plan_clean({0: [describe_pid(orphan.pid)]})
    asked: list[CleanPlan] = []
    report = execute_clean(plan, confirm=lambda p: asked.append(p) is None, grace_s=2.0)
    assert asked == [plan]
    assert report.confirmed
    assert [o.result for o in report.outcomes] == ["terminated"]
    assert exited(orphan)


def test_pid_reuse_is_caught_by_the_start_time_recheck(spawn):
    orphan = spawn.orphan("sleep 60")
    holder = describe_pid(orphan.pid)
    # The plan was made for an older process that had this pid: same pid, other start.
    earlier = dataclasses.replace(holder, start_time=holder.start_time - 1000.0)
    plan = CleanPlan((CleanEntry(earlier, (0,), "orphaned (test)"),), ())
    report = execute_clean(plan, confirm=None, grace_s=0.5)
    (outcome,) = report.outcomes
    assert outcome.result.startswith(f"failed: pid {orphan.pid} is now a different process")
    assert not report.ok
    time.sleep(0.2)
    assert running(orphan)


def test_owner_change_is_caught_by_the_uid_recheck(spawn):
    orphan = spawn.orphan("sleep 60")
    holder = dataclasses.replace(describe_pid(orphan.pid), uid=os.getuid() + 1)
    plan = CleanPlan((CleanEntry(holder, (0,), "orphaned (test)"),), ())
    (outcome,) = execute_clean(plan, confirm=None, grace_s=0.5).outcomes
    assert outcome.result == (
        f"failed: pid {orphan.pid} now belongs to uid {os.getuid()}, "
        f"not uid {os.getuid() + 1}; not signalled"
    )
    time.sleep(0.2)
    assert running(orphan)


def test_candidate_that_exited_meanwhile_is_gone(spawn):
    orphan = spawn.orphan("sleep 60")
    plan = plan_clean({0: [describe_pid(orphan.pid)]})
    orphan.kill()
    wait_for(lambda: exited(orphan), what="orphan to die")
    report = execute_clean(plan, confirm=None, grace_s=0.5)
    assert [o.result for o in report.outcomes] == ["gone"]


def test_negative_grace_is_a_usage_error():
    with pytest.raises(UserInputError, match="grace_s=-1"):
        execute_clean(CleanPlan((), ()), confirm=None, grace_s=-1)


def test_empty_plan_asks_nothing():
    report = execute_clean(CleanPlan((), ()), confirm=lambda _p: pytest.fail("asked"))
    assert report.outcomes == ()
    assert "Nothing to stop." in report.text()


# --------------------------------------------------------------------------- never candidates


def test_this_process_and_its_ancestors_are_never_candidates():
    chain = [psutil.Process(), *psutil.Process().parents()]
    # Even marked orphaned, they stay protected: the rule is the pid, not the evidence.
    holders = [dataclasses.replace(describe_pid(p.pid), orphaned=True) for p in chain]
    plan = plan_clean({0: holders}, uid=os.getuid())
    assert not plan.candidates
    reasons = {s.holder.pid: s.reason for s in plan.skipped}
    assert reasons[os.getpid()] == "this process: never stopped by clean"
    for parent in chain[1:]:
        if parent.pid == 1:
            continue
        assert reasons[parent.pid] == "an ancestor of this process: never stopped by clean"


def test_protected_pid_is_never_a_candidate(spawn):
    orphan = spawn.orphan("sleep 60")
    skipped = only_skipped(plan_clean({0: [describe_pid(orphan.pid)]}, protect={orphan.pid}))
    assert skipped.reason == "protected by the caller: never stopped by clean"
    assert skipped.gpus == (0,)


def test_recorded_holder_is_never_a_candidate(spawn):
    orphan = spawn.orphan("sleep 60")
    live = describe_pid(orphan.pid)
    assert live.orphaned
    # The same real, orphaned pid of this user, but the fact comes from a fleet file.
    as_recorded = dataclasses.replace(live, recorded=True)
    from_file = recorded_holder(4_200_000, "running", "me", "python x.py", None, 1.0)
    plan = plan_clean({0: [as_recorded], 1: [from_file]})
    assert not plan.candidates
    assert {s.holder.pid for s in plan.skipped} == {orphan.pid, 4_200_000}
    assert all(s.reason.startswith("recorded in a fleet file") for s in plan.skipped)
    report = execute_clean(plan, confirm=None)
    assert report.outcomes == ()
    assert running(orphan)


def test_other_users_process_is_never_a_candidate(spawn):
    orphan = spawn.orphan("sleep 60")
    someone_else = os.getuid() + 1
    skipped = only_skipped(plan_clean({0: [describe_pid(orphan.pid)]}, uid=someone_else))
    assert skipped.reason.startswith("belongs to ")
    assert skipped.reason.endswith("not you: clean only stops your own processes")


def test_live_child_of_a_live_job_is_skipped_naming_the_job(spawn):
    job = spawn.child(
        ["sh", "-c", "sleep 60 </dev/null >/dev/null 2>&1 & echo $!; wait"],
        stdout=subprocess.PIPE,
    )
    assert job.stdout is not None
    worker = spawn.track(int(job.stdout.readline()))
    wait_for(lambda: worker.name() == "sleep", what="exec")
    own_child = spawn.child(["sleep", "60"])
    plan = plan_clean({0: [describe_pid(worker.pid)], 1: [describe_pid(own_child.pid)]})
    assert not plan.candidates
    reasons = {s.holder.pid: s.reason for s in plan.skipped}
    command = " ".join(psutil.Process(job.pid).cmdline())
    assert reasons[worker.pid] == (
        f"alive, parent pid {job.pid} ({command[:37]}...) still running: stop that job instead"
    )
    assert reasons[own_child.pid] == (
        f"alive, parent pid {os.getpid()} (this process) still running: stop that job instead"
    )


def test_zombie_is_skipped_with_advice_naming_its_parent(spawn):
    parent = spawn.child(["sh", "-c", "sleep 0 & echo $!; exec sleep 60"], stdout=subprocess.PIPE)
    assert parent.stdout is not None
    zombie = spawn.track(int(parent.stdout.readline()))
    wait_for(lambda: zombie.status() == psutil.STATUS_ZOMBIE, what="zombie")
    skipped = only_skipped(plan_clean({3: [describe_pid(zombie.pid)]}))
    assert skipped.reason == (
        f"zombie (already exited): signals cannot clear it; its parent pid {parent.pid} "
        "(sleep 60) must reap it: stop or restart that parent"
    )


def test_dead_and_host_pids_are_skipped_with_what_to_do():
    other_ns = ContainerInfo(in_container=True, host_pid_namespace=False, reason="test")
    host_pid = describe_pid(free_pid(), container=other_ns)
    plan = plan_clean({0: [describe_pid(4_194_305)], 1: [host_pid]})
    assert not plan.candidates
    reasons = {s.holder.pid: s.reason for s in plan.skipped}
    assert reasons[4_194_305].startswith("already gone: nothing to stop.")
    assert reasons[host_pid.pid].startswith("not in this PID namespace (a host pid)")


# --------------------------------------------------------------------------- rendering


def _holder(pid: int, **fields: object) -> HolderInfo:
    base = HolderInfo(
        pid=pid,
        state="alive",
        user="a-rather-long-user-name",
        uid=1000,
        command="python -m sglang.launch_server " + "--flag value " * 20,
        status="sleeping",
        start_time=1.0,
        ppid=1,
        orphaned=True,
        visible_devices="0",
        torchelastic=False,
        orphan_reason="reparented to pid 1: its launcher is gone",
    )
    return dataclasses.replace(base, **fields)


def test_plan_and_report_text_fit_80_columns():
    plan = CleanPlan(
        candidates=(
            CleanEntry(_holder(4242), (0, 1, 2, 3), "orphaned " + "very long reason " * 12),
            CleanEntry(_holder(4243, command=None), (), "holds /dev/nvidia0", ("/dev/nvidia0",)),
        ),
        skipped=(CleanEntry(_holder(4_194_305, user=None), (5,), "already gone: " + "x " * 60),),
    )
    text = plan.text()
    assert (
        text.splitlines()[0] == "nbgpu clean: 2 stale process(es) of yours to stop, 1 left alone."
    )
    for pid in ("4242", "4243", "4194305"):
        assert f"pid {pid}" in text
    assert "GPU 0,1,2,3" in text
    assert "fd only" in text
    for line in text.splitlines():
        assert len(line) <= 80, line
    assert plan_clean({}).text() == "nbgpu clean: no process holds a GPU or a /dev/nvidia* file."
