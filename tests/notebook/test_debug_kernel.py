"""pdb on a warm job's rank through a real Jupyter kernel, as a notebook drives it: the
cell runs with ``allow_stdin``, every pdb prompt arrives as an ``input_request`` on the
stdin channel and is answered there (what JupyterLab's input box sends back).
"""

import queue
import re
import time

import pytest

from tests.notebook.test_kernel_e2e import kernel  # noqa: F401

pytestmark = pytest.mark.slow

START = "%%torchrun 2 --keep --name {name}\nimport os\nrank = int(os.environ['RANK'])\nkept = 7\n"
FAILS = (
    "%%torchrun --on {name}{flags}\n"
    "def step(batch):\n"
    "    x = batch * 21\n"
    "    raise ValueError(f'bad batch {{batch}}')\n"
    "if rank == 1:\n"
    "    step(2)\n"
)
NEXT = "%%torchrun --on {name}\nkept += 1\nprint('next', kept)\n"
INTERRUPT = "the notebook's stop button instead of an answer"


def run(client, code, answers=None, timeout=120, km=None):
    """Execute *code*; answer each input request with the next of *answers* (None: the
    cell may not ask, ``allow_stdin`` is off as under nbconvert): a line, INTERRUPT, or
    (line, S): the line, then the stop button S seconds later. Returns (output, error,
    prompts) with ANSI colours removed."""
    msg_id = client.execute(code, allow_stdin=answers is not None)
    answers = list(answers or [])
    out, prompts, error = [], [], None
    deadline = time.time() + timeout
    press_at = None  # (from this thread: jupyter_client leaves an event loop in any other)
    while time.time() < deadline:
        if press_at is not None and time.monotonic() >= press_at:
            km.interrupt_kernel()
            press_at = None
        try:
            request = client.get_stdin_msg(timeout=0.02)
        except queue.Empty:
            pass
        else:
            if request["msg_type"] == "input_request":
                prompts.append(request["content"]["prompt"])
                answer = answers.pop(0) if answers else "q"
                if answer == INTERRUPT:
                    km.interrupt_kernel()
                elif isinstance(answer, tuple):
                    client.input(answer[0])
                    press_at = time.monotonic() + answer[1]
                else:
                    client.input(answer)
        try:
            msg = client.get_iopub_msg(timeout=0.02)
        except queue.Empty:
            continue
        if msg["parent_header"].get("msg_id") != msg_id:
            continue
        kind, content = msg["msg_type"], msg["content"]
        if kind == "stream":
            out.append(content["text"])
        elif kind == "error":
            error = f"{content['ename']}: {content['evalue']}"
        elif kind == "status" and content["execution_state"] == "idle":
            break
    plain = re.sub(r"\x1b\[[0-9;]*m", "", "".join(out))
    return plain, error and re.sub(r"\x1b\[[0-9;]*m", "", error), prompts


def one_line_error(out, error):
    """What IPython shows for a UsageError: one line, no traceback."""
    assert error is None, error
    said = [line for line in out.splitlines() if line.startswith("UsageError: ")]
    assert len(said) == 1, out
    assert "Traceback" not in out, out
    return said[0]


def test_post_mortem_and_breakpoint_answer_the_notebooks_input_requests(kernel):  # noqa: F811
    _km, client = kernel
    assert run(client, "%load_ext nbgpu")[1] is None
    out, error, _ = run(client, START.format(name="w"))
    assert error is None, out
    out, error, _ = run(client, FAILS.format(name="w", flags=""))
    assert error.startswith("CellFailed"), (out, error)
    # %gpu_debug: the lowest failed rank of the latest warm job; the prompts come here.
    out, error, prompts = run(client, "%gpu_debug", answers=["p x", "where", "c"])
    assert error is None, out
    assert prompts == ["[rank1] (Pdb) "] * 3
    assert "[rank1] 42\n" in out  # the failing frame's local variable
    assert "[rank1] > cell2.py(3)step()\n[rank1] -> raise ValueError(f'bad batch {batch}')" in out
    assert "[rank1]   cell2.py(5)<module>()\n[rank1] -> step(2)" in out  # where: the cell's line
    out, error, _ = run(client, NEXT.format(name="w"))
    assert error is None, out
    assert "[rank0] next 8" in out
    assert "[rank1] next 8" in out
    # --pdb: a failed cell opens the same prompt on its own, then fails as it would.
    out, error, prompts = run(client, FAILS.format(name="w", flags=" --pdb"), answers=["p batch"])
    assert error.startswith("CellFailed"), (out, error)
    assert prompts == ["[rank1] (Pdb) "] * 2  # the second one answered "q"
    assert "[rank1] 2\n" in out
    # breakpoint() on one rank: it waits for the notebook; the other rank goes on; c resumes.
    cell = (
        "%%torchrun --on w --pull y --all-ranks\ny = rank * 10 + 5\nif rank == 1:\n"
        "    breakpoint()\n    y += 1\nprint('done', y)\n"
    )
    out, error, prompts = run(client, cell, answers=["p y", "c"])
    assert error is None, out
    assert prompts == ["[rank1] (Pdb) "] * 2
    assert "[rank1] > cell5.py(4)<module>()\n[rank1] -> y += 1" in out
    assert "[rank1] 15\n" in out
    assert "[rank1] done 16" in out
    assert "[rank0] done 5" in out
    assert run(client, "print(y)")[0] == "[5, 16]\n"
    # Scripted, for saved notebooks: no input request at all.
    run(client, FAILS.format(name="w", flags=""))
    out, error, _ = run(client, '%gpu_debug w 1 -c "p x" -c where')
    assert error is None, out
    assert "[rank1] (Pdb) p x\n[rank1] 42\n[rank1] (Pdb) where\n" in out
    out, error, _ = run(client, NEXT.format(name="w"))
    assert error is None, out
    assert "[rank1] next 9" in out


def test_the_stop_button_during_a_debugger_session_keeps_the_job(kernel):  # noqa: F811
    # At the prompt it ends the session; during a long command it cancels the command,
    # then ends the session; at a breakpoint() it stops the cell, as in any cell.
    km, client = kernel
    assert run(client, "%load_ext nbgpu")[1] is None
    out, error, _ = run(client, START.format(name="w"))
    assert error is None, out
    run(client, FAILS.format(name="w", flags=""))
    out, error, prompts = run(client, "%gpu_debug", answers=[INTERRUPT], km=km)
    assert error is None, out
    assert len(prompts) == 1
    began = time.monotonic()
    sleep = ("p __import__('time').sleep(60)", 1.0)
    out, error, prompts = run(client, "%gpu_debug", answers=[sleep], km=km)
    assert time.monotonic() - began < 20
    assert error is None, out
    assert "KeyboardInterrupt" in out
    out, error, _ = run(client, NEXT.format(name="w"))
    assert error is None, out
    assert "[rank0] next 8" in out
    assert "[rank1] next 8" in out


def test_the_stop_button_at_a_breakpoint_fails_the_cell_and_keeps_the_job(kernel):  # noqa: F811
    km, client = kernel
    assert run(client, "%load_ext nbgpu")[1] is None
    out, error, _ = run(client, START.format(name="w"))
    assert error is None, out
    cell = "%%torchrun --on w\nif rank == 1:\n    breakpoint()\n    kept = 0\n"
    out, error, _ = run(client, cell, answers=[INTERRUPT], km=km)
    assert error.startswith("CellFailed"), (out, error)
    out, error, _ = run(client, "%%torchrun --on w\nprint('after', rank)")
    assert error is None, out
    assert "[rank0] after 0" in out
    assert "[rank1] after 1" in out


def test_bad_input_is_one_line_and_the_job_runs_the_next_cell(kernel):  # noqa: F811
    _km, client = kernel
    assert run(client, "%load_ext nbgpu")[1] is None
    out, error, _ = run(client, "%gpu_debug 1")
    assert "no warm job in this kernel" in one_line_error(out, error)
    # --pdb on the cell that starts the job: its failure opens pdb too.
    cell = START.format(name="b") + "if rank == 1:\n    x = 42\n    raise ValueError('at start')\n"
    out, error, prompts = run(client, cell.replace(" --keep", " --keep --pdb"), answers=["p x"])
    assert error.startswith("CellFailed"), (out, error)
    assert prompts == ["[rank1] (Pdb) "] * 2
    assert "[rank1] 42\n" in out
    cases = {
        "%gpu_debug 0": "%gpu_debug b: rank 0 failed in the last cell of 'b' (cell 1); rank 1 "
        "did: %gpu_debug b 1",
        "%gpu_debug b 5": "%gpu_debug b 5: 'b' has ranks 0 to 1",
        "%gpu_debug nosuch 1": "%gpu_debug nosuch: no warm job named 'nosuch' (warm jobs: b)",
        "%gpu_debug 1 2": "%gpu_debug 1 2: expected %gpu_debug [NAME] [RANK] [-c CMD ...]",
        "%%torchrun 2 --pdb\nprint(1)": "--pdb debugs a failed cell of a warm job",
    }
    for code, message in cases.items():
        out, error, _ = run(client, code)
        assert one_line_error(out, error).startswith(f"UsageError: {message}"), out
    # input() unavailable (nbconvert, nbval): one line that points to -c.
    out, error, _ = run(client, "%gpu_debug 1")
    said = one_line_error(out, error)
    assert said.endswith("give pdb's commands with -c, e.g. %gpu_debug b 1 -c 'p x' -c where")
    # ...and a breakpoint() there lets its rank go on, saying so once.
    out, error, _ = run(client, "%%torchrun --on b\nif rank == 0:\n    breakpoint()\nprint('on')")
    assert error is None, out
    assert out.count("rank 0 stopped at breakpoint(): no input() here") == 1
    assert "[rank0] on" in out
    out, error, _ = run(client, NEXT.format(name="b"))
    assert error is None, out
    assert "[rank1] next 8" in out
    # A rank that did not fail this time; then a job that ended.
    out, error, _ = run(client, "%gpu_debug b")
    assert "no rank failed in the last cell of 'b' (cell 3)" in one_line_error(out, error)
    assert run(client, "%gpu_stop b")[1] is None
    out, error, _ = run(client, "%gpu_debug 1")
    assert "%gpu_debug b: the job has ended (stopped)" in one_line_error(out, error)
