"""The catalog: every failure cause nbgpu can name, how it is recognised, and the fix.

Data, not logic. Each :class:`Cause` carries an id (a stable contract: reports, JSON and
tests use it), a title, a plain-words explanation, generic fixes that name nbgpu calls and
flags, and :class:`Pattern` objects: regular expressions for the phrasings seen in real
logs across torch, CUDA, NCCL, DeepSpeed and launcher versions (``tests/diagnose/corpus``
holds the logs they were written against). A pattern carries its own confidence: an
exact CUDA error name is near-certain, an exit code of -9 only suggests the OOM killer.
"""

import re
from dataclasses import dataclass
from typing import Any

from nbgpu.diagnose.report import FoundCause

__all__ = ["CATALOG", "CAUSE_IDS", "SECONDARY", "SECONDARY_KEYWORDS", "STALLED", "TRIGGERS",
           "UNKNOWN", "Cause", "Pattern", "candidates", "cause"]  # fmt: skip


@dataclass(frozen=True)
class Pattern:
    """One phrasing of a cause. ``confidence`` is how sure a match alone makes us."""

    regex: re.Pattern[str]
    confidence: float
    name: str
    # A match that usually reports a peer's failure, not this rank's own (NCCL's
    # "remote process exited"): it never makes its rank the root cause on its own.
    consequence: bool = False


def _p(regex: str, confidence: float, name: str, *, consequence: bool = False) -> Pattern:
    return Pattern(re.compile(regex, re.IGNORECASE), confidence, name, consequence)


@dataclass(frozen=True)
class Cause:
    """A failure cause: recognition, explanation and fixes."""

    id: str
    title: str
    explanation: str
    fixes: tuple[str, ...]
    patterns: tuple[Pattern, ...]
    # Lower-case substrings, one of which every pattern's match contains: a cheap test
    # that skips the regexes on the many lines that cannot match.
    keywords: tuple[str, ...]
    # Higher wins when two causes fail the same rank at the same moment: the specific
    # cause (a device assert) explains the generic one (an NCCL error) and not the reverse.
    priority: int
    # Causes that are usually the echo of another rank's failure (collective timeouts,
    # NCCL errors) rank below any primary cause, whatever their timing.
    secondary: bool = False

    def found(self, role: str, confidence: float, **fields: Any) -> FoundCause:
        return FoundCause(
            cause=self.id,
            title=self.title,
            role=role,
            confidence=round(confidence, 3),
            explanation=self.explanation,
            fixes=self.fixes,
            **fields,
        )

    def search(self, text: str) -> Pattern | None:
        """The first pattern matching ``text``, without the keyword test (:func:`candidates`)."""
        return next((p for p in self.patterns if p.regex.search(text)), None)


# Laid out by hand, one row per pattern: the table reads down, not across wrapped calls.
# Each entry: id and title, the explanation, fixes, patterns, then keywords and priority.
# fmt: off
CATALOG: tuple[Cause, ...] = (
    Cause("cuda_busy", "GPU busy or unavailable",
        "CUDA could not create a context on the GPU (CUDA error 46). The GPU is in "
        "exclusive-process (or prohibited) compute mode and another process - often a "
        "dead or zombie rank of an earlier run - still holds it, or two ranks of this "
        "job were mapped to the same exclusive GPU.",
        fixes=(
            ("`%gpu_doctor` (`nbgpu doctor`) names the GPU, its compute mode and the process "
             "holding it"),
            "free a GPU held by your own stale process: `nbgpu clean` (`%gpu_clean`)",
            "leave the GPU out of the job: `%%torchrun --gpus 1,2,3` (`nbgpu run --gpus 1,2,3`)",
            ("in exclusive-process mode give every rank its own GPU (use LOCAL_RANK, or "
             "`nbgpu.rank.device()`, for `torch.cuda.set_device`)"),
        ),
        patterns=(
            _p(r"busy or unavailable", 0.95, "busy-or-unavailable"),
            _p(r"cudaErrorDevicesUnavailable|CUDA_ERROR_DEVICE_UNAVAILABLE", 0.95, "cuda-46-name"),
            _p(r"\(46 vs\. 0\)", 0.9, "check-46"),
            _p(r"cuda.{0,40}error\s*(?:=|\(|:)\s*46\b", 0.85, "error-46"),
        ),
        keywords=("busy", "unavailable", "46"), priority=80,
    ),
    Cause("invalid_ordinal", "Invalid or duplicate device ordinal",
        "A rank asked for a GPU that does not exist in its view (cuda:N with N >= the "
        "number of visible GPUs), or two ranks landed on the same GPU. Typical causes: "
        "more ranks per node than visible GPUs (a hard-coded --nproc_per_node), "
        "CUDA_VISIBLE_DEVICES listing fewer GPUs than ranks, or set_device(RANK) instead "
        "of set_device(LOCAL_RANK) on a second node.",
        fixes=(
            ("let nbgpu size the job from the healthy GPUs: `%%torchrun` with no count, or "
             "`%%torchrun N` with N no larger than `%gpu_status` shows"),
            "pick the GPUs explicitly: `%%torchrun --gpus 0,1` (one rank per listed GPU)",
            ("select the device with LOCAL_RANK, not RANK: `torch.cuda.set_device(int(os.environ"
             "['LOCAL_RANK']))` or `nbgpu.rank.device()`"),
        ),
        patterns=(
            _p(r"invalid device ordinal", 0.95, "invalid-device-ordinal"),
            _p(r"cudaErrorInvalidDevice\b|CUDA_ERROR_INVALID_DEVICE\b", 0.95, "cuda-101-name"),
            _p(r"\(101 vs\. 0\)", 0.9, "check-101"),
            _p(r"cuda.{0,40}error\s*(?:=|\(|:)\s*101\b", 0.85, "error-101"),
            _p(r"Invalid device id", 0.8, "invalid-device-id"),
            _p(r"Duplicate GPU detected", 0.9, "nccl-duplicate-gpu"),
        ),
        keywords=("ordinal", "invaliddevice", "invalid_device", "101", "device id", "duplicate gpu"), priority=80,
    ),
    Cause("cuda_oom", "GPU out of memory",
        "A rank asked the CUDA allocator for more GPU memory than was free on its GPU. "
        "Either the per-GPU batch, sequence length or model shard is too large for the "
        "card, memory is fragmented, or another process on the same GPU already holds "
        "part of it.",
        fixes=(
            ("lower the per-GPU micro batch (keep the global batch with gradient accumulation) "
             "or the sequence length; enable activation checkpointing"),
            ("`%gpu_plan --model 7B --strategy zero2` shows the model states per GPU before "
             "the next launch"),
            "against fragmentation: `%%torchrun --env PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`",
            "check that nothing else uses the GPU: `%gpu_status`",
        ),
        patterns=(
            _p(r"CUDA out of memory", 0.95, "cuda-out-of-memory"),
            _p(r"OutOfMemoryError", 0.95, "oom-exception"),
            _p(r"CUDA error: out of memory|cuda runtime error \(2\)", 0.95, "cuda-error-2"),
            _p(r"CUDA_ERROR_OUT_OF_MEMORY|cudaErrorMemoryAllocation", 0.95, "cuda-oom-name"),
            _p(r"Cuda failure '?out of memory|Failed to CUDA calloc", 0.9, "nccl-cuda-oom"),
            _p(r"(?:cuda|gpu|hip)\b.{0,40}out of memory", 0.85, "gpu-out-of-memory"),
            _p(r"RESOURCE_EXHAUSTED: Out of memory", 0.85, "xla-oom"),
            _p(r"CUBLAS_STATUS_ALLOC_FAILED", 0.8, "cublas-alloc"),
        ),
        keywords=("out of memory", "outofmemory", "out_of_memory", "memoryallocation", "calloc", "alloc_failed"), priority=75,
    ),
    Cause("host_oom", "Host (CPU) memory exhausted",
        "The machine ran out of RAM (or of a memory limit: cgroup, container, "
        "RLIMIT_AS, /dev/shm) and the kernel's OOM killer sent SIGKILL (exit -9, "
        "status 137), or an allocation failed (std::bad_alloc, MemoryError). Every rank "
        "loads its own copy of the model and libraries: N ranks importing or loading "
        "checkpoints at once multiply the peak.",
        fixes=(
            ("load one rank at a time: `%%torchrun --serial-imports` (heavy imports and "
             "checkpoint loading under a cross-rank lock)"),
            "cap each rank so one fails cleanly instead of the whole box: `%%torchrun --mem-limit 60G`",
            ("fewer DataLoader workers, memory-mapped datasets, load weights with mmap=True; "
             "for shared-memory errors raise the container's --shm-size"),
            "confirm with the kernel log: `dmesg -T | grep -i -E 'killed process|oom'`",
        ),
        patterns=(
            _p(r"Out of memory: Kill(?:ed)? process|invoked oom-killer|oom-kill:|oom_reaper", 0.95, "kernel-oom-killer"),
            _p(r"Memory cgroup out of memory", 0.95, "cgroup-oom"),
            _p(r"std::bad_alloc", 0.85, "bad-alloc"),
            _p(r"(?<![\w.])MemoryError\b|Cannot allocate memory|\[Errno 12\]", 0.85, "enomem"),
            _p(r"out of shared memory|shared memory limit|insufficient shared memory|No space left on device.{0,40}/dev/shm", 0.85, "shm"),
            _p(r"killed by signal: (?:Killed|Bus error)", 0.75, "dataloader-killed"),
            _p(r"Signal 9 \(SIGKILL\)|<Signals\.SIGKILL: 9>|terminated with signal SIGKILL", 0.6, "sigkill"),
            _p(r"exitcode\s*:?\s*-9\b|exit (?:code|status) 137\b|return code =? ?-9\b", 0.6, "exit-minus-9"),
            # The shell prints "Killed" where the cursor is: on a line of its own, after
            # a job number, or glued to a progress bar that had no newline ("...it/s]").
            _p(r"(?:^|\d\s+|:\s+|[\]|\r])Killed(?:\s+\S.*)?$", 0.65, "shell-killed"),
        ),
        keywords=("memory", "oom", "bad_alloc", "errno 12", "killed", "sigkill", "-9", "137"), priority=60,
    ),
    Cause("nccl_timeout", "Collective operation timed out",
        "A collective (all-reduce, broadcast, barrier...) waited longer than the process "
        "group timeout. Almost always one rank never reached it: it crashed, hung, was "
        "killed, or runs a different code path (an if rank == 0 branch, an uneven last "
        "batch, a slow checkpoint save). The rank that failed first is the one to read.",
        fixes=(
            ("read the rank that failed or stopped printing first (its log ends earliest); "
             "a rank that is still in a long step makes the others time out"),
            ("make every rank run the same collectives in the same order (no collective "
             "inside `if rank == 0`; drop_last=True for uneven data)"),
            ("more detail on the next run: `%%torchrun --env NCCL_DEBUG=INFO "
             "--env TORCH_NCCL_TRACE_BUFFER_SIZE=2000`"),
            "only for legitimately slow steps, raise `timeout=` in `init_process_group`",
        ),
        patterns=(
            _p(r"Watchdog caught collective operation timeout", 0.9, "watchdog-timeout"),
            _p(r"ran for \d+ milliseconds before timing out", 0.9, "ran-for-ms"),
            _p(r"Heartbeat monitor timed out|watchdog got stuck", 0.8, "heartbeat"),
            _p(r"dump signal due to a collective timeout|collective operation timeout", 0.85, "collective-timeout"),
            _p(r"Timed out waiting \d+ms for (?:recv|send) operation", 0.8, "gloo-timeout"),
            _p(r"NCCL timeout|Some NCCL operations have failed or timed out", 0.6, "nccl-failed-or-timed-out"),
        ),
        keywords=("timeout", "timing out", "timed out", "watchdog"), priority=20, secondary=True,
    ),
    Cause("nccl_error", "NCCL communication error",
        "NCCL failed to set up or run a collective: a network or socket problem between "
        "ranks (wrong interface, firewall, no route), a broken peer-to-peer or "
        "shared-memory path inside the box, or a CUDA error underneath NCCL. When "
        "another rank crashed first, this is only the echo of that crash.",
        fixes=(
            "rerun with `%%torchrun --env NCCL_DEBUG=INFO` and read the first `NCCL WARN` line",
            ("pick the network interface: `--env NCCL_SOCKET_IFNAME=eth0` (multi-node), or "
             "`--env NCCL_IB_DISABLE=1` without InfiniBand"),
            ("inside one box, if P2P is broken: `--env NCCL_P2P_DISABLE=1`; in containers give "
             "/dev/shm room (`--shm-size`)"),
            "`%gpu_doctor` checks the GPUs the ranks run on",
        ),
        patterns=(
            _p(r"remote process exited or there was a network error", 0.5, "peer-exited", consequence=True),
            _p(r"NCCL communicator was aborted|ProcessGroupNCCL is aborted", 0.4, "aborted", consequence=True),
            _p(r"NCCL error", 0.85, "nccl-error"),
            _p(r"nccl(?:System|Internal|UnhandledCuda|InvalidUsage|InvalidArgument|Remote)Error", 0.85, "nccl-result"),
            _p(r"unhandled (?:system|cuda) error", 0.8, "unhandled-error"),
            _p(r"NCCL WARN", 0.7, "nccl-warn"),
            _p(r"DistBackendError", 0.7, "dist-backend-error"),
        ),
        keywords=("nccl", "unhandled", "distbackenderror", "remote process"), priority=30, secondary=True,
    ),
    Cause("collective_mismatch", "Ranks called collectives that do not match",
        "The ranks reached the same collective call slot with different operations or "
        "tensor sizes (one rank reduces 8 floats while the others reduce 16, one calls "
        "barrier while the others all_reduce). Gloo detects the size difference and "
        "aborts the rank; NCCL may instead hang or corrupt data silently.",
        fixes=(
            ("make every rank call the same collectives, in the same order, with tensors of the "
             "same shape: look for `if rank == ...` around a collective and for per-rank "
             "shapes (the last batch of an uneven split)"),
            ("`%%torchrun --env TORCH_DISTRIBUTED_DEBUG=DETAIL` checks every call and names the "
             "mismatching op and shapes before it runs"),
        ),
        patterns=(
            _p(r"Received data size doesn't match expected size", 0.9, "gloo-size-mismatch"),
            _p(r"Detected mismatch between collectives", 0.95, "debug-detail-mismatch"),
            _p(r"collective mismatch|mismatched collective", 0.8, "collective-mismatch"),
        ),
        keywords=("match expected size", "mismatch between collectives", "collective mismatch",
                  "mismatched collective"), priority=65,
    ),
    Cause("port_in_use", "Rendezvous port already in use",
        "The master (rank 0 / the torchrun agent) could not listen on MASTER_PORT: "
        "another job - often a second run on the same box, or a stale run of yours - "
        "already holds it (torchrun's default 29500 is shared by every job that keeps "
        "the default), or the port is privileged (< 1024).",
        fixes=(
            ("let nbgpu pick a free port: `%%torchrun` chooses one unless you pass "
             "`--master-port`; concurrent runs from `%gpu_plan` get distinct ports"),
            "or set a different one: `%%torchrun --master-port 29611` (`nbgpu run --master-port 29611`)",
            "stop your stale run holding it: `%gpu_runs` lists runs, `nbgpu clean` stops stale ones",
        ),
        patterns=(
            _p(r"Address already in use|EADDRINUSE|errno:? 98\b", 0.95, "eaddrinuse"),
            _p(r"server socket has failed to (?:listen|bind)", 0.85, "server-socket"),
        ),
        keywords=("address already", "eaddrinuse", "errno", "server socket"), priority=70,
    ),
    Cause("rendezvous", "Rendezvous failed (ranks or nodes could not meet)",
        "The ranks could not reach the rendezvous store on the master node in time: "
        "the --rdzv-endpoint / MASTER_ADDR:MASTER_PORT is wrong or unreachable (firewall, "
        "wrong interface), not every node was started (--nnodes), or the nodes used "
        "different --rdzv-id values.",
        fixes=(
            ("check that every node can reach the master's host:port (`nc -zv HOST PORT`) and "
             "that all nodes use the same --rdzv-id and --nnodes"),
            "on one node, let nbgpu run standalone: `%%torchrun 4` (local rendezvous)",
        ),
        patterns=(
            _p(r"Rendezvous\w*Error", 0.9, "rendezvous-error"),
            _p(r"client socket has timed out after", 0.85, "client-socket-timeout"),
            _p(r"connect\(\) timed out|Timed out waiting for clients", 0.85, "connect-timeout"),
            _p(r"store based barrier", 0.8, "store-barrier"),
            _p(r"DistStoreError|TCPStore.{0,80}(?:timed out|failed|refused)", 0.75, "store-error"),
            _p(r"client socket.{0,80}(?:Connection refused|failed to connect)", 0.75, "client-refused"),
        ),
        keywords=("rendezvous", "client socket", "timed out", "store"), priority=40,
    ),
    Cause("batch_divisibility", "Batch (or parallel size) not divisible by the ranks",
        "A size that the parallel layout splits across ranks does not divide evenly: the "
        "global batch by the data-parallel world size (times micro batch and gradient "
        "accumulation), or heads/layers by the tensor- or pipeline-parallel size. "
        "Changing the number of GPUs changes which sizes are valid.",
        fixes=(
            ("use a batch size that is a multiple of world size x micro batch "
             "(`%gpu_plan` / `nbgpu.plan(...)` lists the valid ones for a GPU count)"),
            "or change the number of training ranks to a divisor of the batch size",
            ("DeepSpeed: set train_batch_size = micro_batch_per_gpu x gradient_accumulation x world_size, "
             "or leave train_batch_size to 'auto'"),
        ),
        patterns=(
            _p(r"train_batch_size is not equal to micro_batch_per_gpu", 0.95, "deepspeed-batch"),
            _p(r"batch[ _]?size.{0,60}(?:must|should) be (?:divisible|a multiple)", 0.95, "batch-must-divide"),
            _p(r"(?:must|should) be divisible by|is not divisible by|not evenly divisible", 0.85, "not-divisible"),
            _p(r"only support equal chunk", 0.85, "equal-chunk"),
            _p(r"Micro batch size per gpu: 0", 0.85, "micro-batch-zero"),
            _p(r"batch[ _-]?size.{0,60}(?:must be|not) (?:a )?multiple of", 0.9, "batch-multiple"),
            # A bare "assert batch_size % world_size == 0" shows only in the traceback's code line.
            _p(r"assert .{0,40}batch.{0,40}%", 0.75, "batch-assert-code"),
            # The same for any size split across ranks (nanoGPT's gradient_accumulation_steps).
            _p(r"assert .{0,60}%\s*\(?\s*(?:\w+_)?world_size\b", 0.8, "world-size-assert-code"),
        ),
        keywords=("divisible", "equal chunk", "micro_batch", "micro batch", "multiple of", "assert"), priority=75,
    ),
    Cause("cuda_init_fork", "CUDA initialised before fork",
        "A process that had already initialised CUDA forked children that use CUDA "
        "(notebook_launcher or Lightning's ddp_notebook after a cell touched the GPU, "
        "DataLoader workers that move tensors to the GPU). CUDA cannot be used in a "
        "forked child once the parent initialised it.",
        fixes=(
            ("launch with `%%torchrun`: it starts fresh processes (no fork), so CUDA state in "
             "the notebook kernel does not matter"),
            ("with fork-based launchers, do not touch torch.cuda in any cell before the launch "
             "(restart the kernel)"),
            ("keep CUDA out of DataLoader workers, or use "
             "`multiprocessing_context='spawn'` / `torch.multiprocessing.set_start_method('spawn')`"),
        ),
        patterns=(
            _p(r"Cannot re-initialize CUDA in forked subprocess", 0.95, "reinit-forked"),
            _p(r"CUDA has been initialized before", 0.9, "notebook-launcher"),
            _p(r"re-initialize CUDA", 0.85, "reinit"),
            _p(r"CUDA error: initialization error|cudaErrorInitializationError", 0.6, "init-error"),
        ),
        keywords=("re-initialize", "initialized before", "spawn", "initialization error", "initializationerror"), priority=85,
    ),
    Cause("driver", "GPU driver or CUDA runtime unusable",
        "CUDA cannot talk to the GPU driver: no driver is loaded (or the container runs "
        "without the NVIDIA runtime), the driver is older than the CUDA version torch "
        "was built for, the user-space library and kernel module disagree after an "
        "upgrade, or the installed torch build has no kernels for this GPU.",
        fixes=(
            "`%gpu_doctor` (`nbgpu doctor`) checks the driver, NVML and what CUDA sees",
            ("install a torch build for the driver's CUDA version (`nvidia-smi` shows the "
             "highest CUDA the driver supports), or upgrade the driver"),
            ("after a driver upgrade, reboot (or reload the nvidia kernel modules); in a "
             "container, run with the NVIDIA runtime (`--gpus all`)"),
        ),
        patterns=(
            _p(r"Found no NVIDIA driver", 0.95, "no-driver"),
            _p(r"NVIDIA driver on your system is too old", 0.95, "driver-too-old"),
            _p(r"driver version is insufficient|cudaErrorInsufficientDriver|cuda runtime error \(35\)", 0.95, "insufficient-driver"),
            _p(r"Driver/library version mismatch|Failed to initialize NVML", 0.9, "nvml-mismatch"),
            _p(r"couldn't communicate with the NVIDIA driver", 0.9, "nvidia-smi-driver"),
            _p(r"no CUDA-capable device is detected|CUDA_ERROR_NO_DEVICE|cudaErrorNoDevice", 0.85, "no-device"),
            _p(r"no kernel image is available for execution on the device", 0.85, "no-kernel-image"),
            _p(r"unsupported display driver / cuda driver combination|CUDA_ERROR_SYSTEM_DRIVER_MISMATCH", 0.9, "driver-mismatch"),
            _p(r"Torch not compiled with CUDA enabled", 0.8, "cpu-torch"),
            # CUDA errors 802/804: fabric manager missing, forward-compat libs on unsupported GPUs.
            _p(r"forward compatibility was attempted on non supported HW|cudaErrorCompatNotSupportedOnDevice"
               r"|Error 80[234]\b|system not yet initialized", 0.85, "cuda-compat"),
        ),
        keywords=("compatib", "error 80", "not yet initialized", "driver", "nvml", "cuda-capable device is", "no_device", "nodevice", "kernel image", "compiled with cuda"), priority=85,
    ),
    Cause("device_assert", "Device-side assertion (usually an index out of range)",
        "A CUDA kernel's own assertion failed - almost always an index out of range on "
        "the GPU: a class label >= num_classes (or negative) in a loss, a token id >= the "
        "embedding size, a bad gather/index_select index. CUDA reports it asynchronously, "
        "so the Python line in the traceback may not be the one at fault.",
        fixes=(
            ("find the exact line: `%%torchrun --env CUDA_LAUNCH_BLOCKING=1` (or run one batch "
             "on CPU, where the same bug raises a clear IndexError)"),
            ("check label and token ranges against num_classes / vocab size (and the "
             "tokenizer matching the model)"),
        ),
        patterns=(
            _p(r"device-side assert(?:ion)? triggered", 0.95, "device-side-assert"),
            _p(r"Assertion `.+` failed", 0.9, "kernel-assertion"),
            _p(r"cudaErrorAssert|CUDA_ERROR_ASSERT|cuda runtime error \(59\)", 0.9, "cuda-assert-name"),
        ),
        keywords=("assert",), priority=90,
    ),
    Cause("illegal_access", "Illegal memory access (a kernel crashed)",
        "A GPU kernel read or wrote memory it does not own (or executed an illegal "
        "instruction). Usual suspects: a custom CUDA/Triton extension or flash-attention "
        "build that does not match torch, CUDA or the GPU; a known bug in a library "
        "version; rarely a failing GPU. The CUDA context is unusable afterwards, so NCCL "
        "and later calls fail too.",
        fixes=(
            "localise it: `%%torchrun --env CUDA_LAUNCH_BLOCKING=1` (or `compute-sanitizer python ...`)",
            ("rebuild or update extensions (flash-attn, apex, custom ops) against the installed "
             "torch and CUDA"),
            ("if it happens on one GPU only, probe it: `nbgpu status --probe`, and exclude it "
             "with `%%torchrun --gpus ...`"),
        ),
        patterns=(
            _p(r"illegal memory access", 0.95, "illegal-memory-access"),
            _p(r"cudaErrorIllegalAddress|CUDA_ERROR_ILLEGAL_ADDRESS|cuda runtime error \(77\)|Cuda failure 700", 0.95, "illegal-address-name"),
            _p(r"misaligned address|illegal instruction was encountered", 0.85, "misaligned"),
            _p(r"unspecified launch failure|cudaErrorLaunchFailure", 0.6, "launch-failure"),
        ),
        keywords=("illegal", "misaligned", "launch failure", "launchfailure", "700"), priority=85,
    ),
    Cause("backend_unavailable", "Process-group backend not available in this torch",
        "The script asked torch.distributed for a backend that the installed torch was "
        "built without or cannot use here: NCCL needs the CUDA build of torch and a GPU "
        "per rank (the CPU wheel has no NCCL), MPI and UCC need a torch built against "
        "them. Every rank fails the same way in init_process_group, before any "
        "communication.",
        fixes=(
            ('on CPU use gloo: `init_process_group(backend="gloo")`, or let '
             "`nbgpu.rank.init()` pick gloo on CPU and nccl on GPUs"),
            ("on a GPU machine install the CUDA build of torch (`pip install torch "
             "--index-url https://download.pytorch.org/whl/cu128`) and check "
             "`torch.distributed.is_nccl_available()`"),
        ),
        patterns=(
            _p(r"Distributed package doesn't have (?:NCCL|MPI|UCC|Gloo) built in", 0.95, "not-built-in"),
            _p(r"ProcessGroupNCCL is only supported with GPUs", 0.9, "nccl-needs-gpus"),
            _p(r"Invalid backend: '?\w+'?|Unknown c10d backend type|Unknown backend type \w+", 0.8, "invalid-backend"),
        ),
        keywords=("built in", "only supported with gpus", "backend"), priority=75,
    ),
    Cause("segfault", "Segmentation fault (native crash)",
        "A process died from SIGSEGV (exit -11, status 139): a crash in native code. "
        "Common sources: a compiled extension built for another torch/CUDA/Python "
        "version, a DataLoader worker crashing in a C library (image decoders, "
        "tokenizers), or incompatible library versions imported together.",
        fixes=(
            "get the Python stack of the crash: `%%torchrun --env PYTHONFAULTHANDLER=1`",
            "if a DataLoader worker crashed, retry with num_workers=0 to see the real error",
            "reinstall compiled extensions against the installed torch; check `pip check`",
        ),
        patterns=(
            _p(r"Segmentation fault|segmentation fault", 0.9, "segmentation-fault"),
            _p(r"SIGSEGV|Signal 11\b", 0.85, "sigsegv"),
            _p(r"exitcode\s*:?\s*-11\b|exit (?:code|status) 139\b|return code =? ?-11\b", 0.85, "exit-minus-11"),
        ),
        keywords=("segmentation", "sigsegv", "signal 11", "-11", "139"), priority=65,
    ),
    Cause("gpu_lost", "GPU lost or hardware fault",
        "The GPU stopped responding: it fell off the PCIe bus (Xid 79), reported an "
        "uncorrectable ECC error, or the driver lost it. No software on the box can use "
        "it again until it is reset, usually by a reboot; if it recurs the card or its "
        "power/cooling is failing.",
        fixes=(
            ("`%gpu_doctor` shows which GPU is lost; the kernel log names it: "
             "`sudo dmesg -T | grep -i xid`"),
            ("reboot (or `sudo nvidia-smi --gpu-reset -i N` when idle); meanwhile leave it out: "
             "`%%torchrun --gpus ...` with the healthy GPUs"),
            "if it recurs, drain the node and ask the provider for a replacement (RMA)",
        ),
        patterns=(
            _p(r"fallen off the bus", 0.95, "fallen-off-bus"),
            _p(r"GPU is lost|GPU_IS_LOST|GpuIsLost", 0.95, "gpu-is-lost"),
            _p(r"Xid \([^)]*\): (?:79|48|74|94|95|119|120|64)\b", 0.9, "xid-fatal"),
            _p(r"uncorrectable ECC error|cudaErrorECCUncorrectable", 0.9, "ecc"),
            _p(r"Unable to determine the device handle for GPU", 0.85, "device-handle"),
            _p(r"GPU requires reset|RESET_REQUIRED", 0.85, "reset-required"),
            _p(r"NVRM: Xid", 0.7, "xid"),
            _p(r"CUDA error: unknown error|CUDA_ERROR_UNKNOWN", 0.5, "cuda-unknown"),
        ),
        keywords=("bus", "lost", "xid", "ecc", "device handle", "reset", "unknown error", "cuda_error_unknown"), priority=95,
    ),
    Cause("cpu_torch", "This torch has no CUDA (a CPU build), or sees no GPU",
        "The script asked for CUDA (torch.cuda.set_device, .cuda(), device='cuda', NCCL) "
        "but the torch the ranks imported cannot give it: a CPU-only build (its version "
        "ends in +cpu, torch.version.cuda is None, and torch._C has no _cuda_* functions), "
        "or a CUDA build that sees no GPU (no GPU on the machine, or CUDA_VISIBLE_DEVICES "
        "naming none that exists). Every rank fails the same way, at its first CUDA call.",
        fixes=(
            ("see what the ranks import: `python -c \"import torch; print(torch.__version__, "
             "torch.version.cuda, torch.cuda.device_count())\"`"),
            ("on a GPU machine install the CUDA build into that python: `pip install torch "
             "--index-url https://download.pytorch.org/whl/cu124` (a cuXYZ no newer than "
             "`nvidia-smi` shows)"),
            ("to rehearse on CPU: `%%torchrun 2 --backend gloo` (`nbgpu run -n 2 --backend gloo "
             "script.py`), with the device from `nbgpu.rank.device()` instead of `cuda:LOCAL_RANK`"),
            ("a CUDA build that sees no GPU: `%gpu_status` (`nbgpu status`) lists the GPUs; "
             "`%%torchrun --gpus 0,1` sets CUDA_VISIBLE_DEVICES to GPUs that exist"),
        ),
        patterns=(
            _p(r"module 'torch\._C' has no attribute '_cuda_\w+'", 0.95, "cpu-build-cuda-attr"),
            _p(r"Torch not compiled with CUDA enabled", 0.95, "not-compiled-with-cuda"),
            _p(r"No CUDA GPUs are available", 0.9, "no-cuda-gpus"),
        ),
        keywords=("_cuda_", "compiled with cuda", "no cuda gpus"), priority=88,
    ),
    Cause("missing_module", "A module is missing in the ranks' Python",
        "A rank imported a module that is not installed in the Python environment the "
        "ranks run. That interpreter is the one the launcher was started with: for "
        "`%%torchrun` the notebook kernel's, for a `torchrun` typed in a shell the one "
        "that `torchrun` on PATH belongs to, which is often not the environment the "
        "package was installed into.",
        fixes=(
            ("install it into the ranks' interpreter (named above when known): "
             "`/path/to/python -m pip install PACKAGE`; in a notebook `%pip install PACKAGE` "
             "installs into the kernel's, the one `%%torchrun` ranks run"),
            ("from a shell, check which environment `torchrun` runs: `which torchrun`; "
             "`python -m torch.distributed.run ...` runs the python you name"),
        ),
        patterns=(
            _p(r"ModuleNotFoundError: No module named", 0.9, "module-not-found"),
            # `python -m MODULE` names its interpreter: "/usr/bin/python: No module named torch.x".
            _p(r"python[\d.]*: No module named", 0.85, "python-m-no-module"),
        ),
        keywords=("no module named",), priority=70,
    ),
    Cause("agent_hangup", "The launcher got SIGHUP: the terminal that started it closed",
        "torchrun's agent received SIGHUP (signal 1) and stopped every rank: the "
        "terminal or SSH session that started it closed. torchrun installs its own "
        "SIGHUP handler, so `nohup torchrun ...` alone does not protect it. The ranks "
        "did not fail; they were stopped.",
        fixes=(
            ("keep the run alive without the terminal: run it inside `tmux` or `screen`, or "
             "start it in its own session: `setsid nbgpu run ... > run.log 2>&1 &`"),
            ("with plain torchrun, `nohup` works only if torchrun leaves SIGHUP alone: "
             "`nohup torchrun --signals-to-handle SIGTERM,SIGINT,SIGQUIT ... &`"),
            ("from a notebook, `%%torchrun --bg` runs in the kernel, not a terminal; start "
             "Jupyter itself under tmux so closing its terminal does not end the kernel"),
        ),
        patterns=(
            _p(r"Received (?:1|Signals\.SIGHUP) death signal", 0.95, "death-signal-hup"),
            _p(r"closing signal SIGHUP", 0.9, "closing-sighup"),
            _p(r"SignalException: Process \d+ got signal: 1$", 0.9, "signal-exception-hup"),
        ),
        keywords=("death signal", "sighup", "got signal: 1"), priority=55,
    ),
    Cause("exit_barrier", "torchrun's exit barrier timed out (nodes finished far apart)",
        "When a node's ranks finish, its torchrun agent waits up to 300 s for the agents "
        "of the other nodes (the exit barrier). One node's ranks were still running, "
        "hung or dead after that wait: uneven work at the end (rank 0 alone saving a "
        "checkpoint or evaluating), a node that crashed, or one that never got the "
        "last collective.",
        fixes=(
            ("end every rank's work together: a `dist.barrier()` after the last save or "
             "evaluation, before the script returns, so no node's ranks exit minutes early"),
            ("if another node failed, its own log holds the root cause: `nbgpu diagnose "
             "NODE_LOG` (`%gpu_diagnose`) on that node's log or run directory"),
            ("torch 2.13's torchrun has no flag for the 300 s wait: shorten the uneven tail "
             "instead (save shards from every rank, evaluate on all ranks)"),
        ),
        patterns=(
            _p(r"Error waiting on exit barrier", 0.95, "exit-barrier"),
            # The store key the agents' exit barrier waits on, in the timeout's own message.
            _p(r"torchelastic/agent/terminal_state", 0.85, "exit-barrier-store-key"),
        ),
        keywords=("exit barrier", "terminal_state"), priority=50,
    ),
    Cause("ray_oom", "Ray killed workers for host memory pressure",
        "Ray's memory monitor (in the raylet) saw the node's RAM use pass its threshold "
        "(RAY_memory_usage_threshold, 0.95 by default) and killed workers (tasks or "
        "actors) to keep the node alive. This is host memory, not GPU memory: too many "
        "workers at once, large CPU-side buffers (rollouts, datasets, offloaded "
        "weights), or a leak that grows each step.",
        fixes=(
            ("lower host memory per worker: fewer rollout or data workers, smaller CPU-side "
             "batches and buffers, less CPU offload"),
            ("run fewer tasks at once: request more CPUs per task (`num_cpus=` in "
             "`@ray.remote` or the trainer's resources)"),
            ("`ray logs raylet.out -ip NODE_IP` shows which processes held the memory; "
             "raising RAY_memory_usage_threshold only hands the kill to the kernel's OOM killer"),
            ("measure a worker's host memory phase by phase on one box first: a `%%torchrun` run "
             "records it (`%gpu_memory NAME`, `nbgpu memory RUNDIR`)"),
        ),
        patterns=(
            _p(r"killed due to memory pressure \(OOM\)", 0.95, "raylet-memory-pressure"),
            _p(r"Task was killed due to the node running low on memory", 0.95, "ray-task-low-memory"),
            _p(r"ray\.exceptions\.OutOfMemoryError", 0.9, "ray-oom-exception"),
        ),
        keywords=("memory pressure", "running low on memory", "ray.exceptions.outofmemory"), priority=78,
    ),
)

#: The cause reported when a rank failed but nothing in the catalog matched.
UNKNOWN = Cause("unknown", "Unrecognised failure",
    "No known cause matched. The traceback of the rank that failed first is shown: it "
    "is the place to start, not the errors of the ranks that failed after it.",
    fixes=(
        "read the root-cause traceback above (the first failing rank's own error)",
        "`%gpu_doctor` rules out the GPUs and the launch environment",
        ("wrap the entry point with torch's `@record` (nbgpu's launcher does) so every rank "
         "writes an error file with its traceback"),
    ),
    patterns=(),
    keywords=(), priority=10,
)

#: A job waiting in a collective for a rank that never came: found from the ranks' flight
#: records (nbgpu's stall.json, NCCL's dumps on a timeout), not from a log line.
STALLED = Cause("stalled_collective", "The job stalled in a collective",
    "Every rank that reached a collective waits in it for a rank that never came (it "
    "is still in its own code: a sleep, a data loader, a rank-dependent branch) or "
    "that called a different collective. Nothing fails until NCCL's watchdog (10 min) "
    "or gloo's timeout (30 min) ends the job, so no log line says which rank it was; "
    "each rank's flight recorder does.",
    fixes=(
        ("the rank named is where to look: a branch on the rank around a collective, an "
         "uneven split (one rank has fewer batches), a DataLoader worker stuck on storage"),
        "every rank's full stack while it hangs: `%gpu_stacks NAME` (`nbgpu stacks RUNDIR`)",
        ("let a stall end the job once it is reported: `%%torchrun --on-hang stop` "
         "(`--hang-after S` to look sooner or later than 120 s)"),
    ),
    patterns=(),
    keywords=(), priority=55,
)

#: Lines that mark a rank as a casualty of another rank's failure.
SECONDARY: tuple[Pattern, ...] = (
    _p(r"Connection reset by peer|Connection closed by (?:remote )?peer|Broken pipe", 0.5, "peer-gone", consequence=True),
    _p(r"closing signal SIGTERM|Received \d+ death signal|got signal: 15|Signal 15 \(SIGTERM\)", 0.5, "sigterm", consequence=True),
    _p(r"exitcode\s*:?\s*-15\b|SignalException", 0.5, "terminated", consequence=True),
    _p(r"Fatal Python error: Aborted|Signal 6 \(SIGABRT\)|exitcode\s*:?\s*-6\b", 0.4, "aborted", consequence=True),
    _p(r"taking the entire process down", 0.4, "nccl-teardown", consequence=True),
)
# fmt: on

#: Lower-case substrings one of which every SECONDARY match contains (tested first).
SECONDARY_KEYWORDS: tuple[str, ...] = ("connection", "broken pipe", "sigterm", "death signal",
                                       "signal: 15", "-15", "signalexception", "aborted",
                                       "sigabrt", "-6", "entire process")  # fmt: skip

# What a log can show (STALLED comes from flight records, never from a line).
CAUSE_IDS: tuple[str, ...] = (*(c.id for c in CATALOG), UNKNOWN.id)
_BY_ID = {c.id: c for c in (*CATALOG, STALLED, UNKNOWN)}


def cause(cause_id: str) -> Cause:
    """The catalog entry for ``cause_id`` (``KeyError`` for an unknown id)."""
    return _BY_ID[cause_id]


# Every keyword of the catalog once, with the causes it stands for. Asking each cause in
# turn tests a shared keyword ("timed out", "assert") once per cause and costs a generator
# per cause per line; one pass over the distinct keywords costs one substring test each.
_KEYWORD_INDEX = tuple(
    (keyword, frozenset(i for i, entry in enumerate(CATALOG) if keyword in entry.keywords))
    for keyword in dict.fromkeys(k for entry in CATALOG for k in entry.keywords)
)


def candidates(lowered: str) -> list[Cause]:
    """The causes, in catalog order, one of whose keywords ``lowered`` contains: the cheap
    prefilter in front of the regular expressions, which only these causes run."""
    found = [i for keyword, causes in _KEYWORD_INDEX if keyword in lowered for i in causes]
    return [CATALOG[i] for i in sorted(set(found))] if found else []


#: What the scanner searches raw bytes for (case-sensitive, all in one regular-expression
#: pass): every failure region in the corpus contains one of these within a few lines. Kept
#: short on purpose - each key is tried wherever its first byte stands; a test checks that
#: the windows find on every corpus log what a full scan finds.
TRIGGERS: tuple[bytes, ...] = (
    b"rror",  # Error, error, cudaError..., ChildFailedError, error_file
    b"RROR",  # ERROR lines: DeepSpeed's launcher reports "exits with return code = -9" only so
    b"NCCL",  # NCCL WARN, ProcessGroupNCCL watchdog/heartbeat
    b"Traceback",
    b"Killed",  # shell "Killed", dmesg "Killed process", "killed by signal: Killed"
    b"SIG",  # SIGKILL / SIGSEGV / SIGTERM / SIGABRT, <Signals.SIG...>
    b"egmentation",  # Segmentation fault / segmentation fault
    b"bad_alloc",
    b"Assertion",  # a log cut short may hold only CUDA's kernel-assertion spam
    b"NVRM",  # kernel log: Xid, fallen off the bus
    b"is lost",  # nvidia-smi: GPU is lost
    b"NVIDIA driver",  # nvidia-smi "couldn't communicate with the NVIDIA driver", "too old"
    b"failed to connect",  # c10d's warnings: "The client socket has failed to connect to ..."
    b"memory pressure",  # Ray's raylet: "N Workers (tasks / actors) killed due to memory pressure"
)
