"""Each private torch API the project uses (dflash.torch_private) is where, and what, the project expects:
this fails when a torch release moves or reshapes one, before a run or a trace meets it. Runs under the
torch of this venv; the torch compat lane (tests/compat) runs it under the other pinned torch."""
from __future__ import annotations

import inspect
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from dflash import torch_private

REPO = Path(__file__).resolve().parents[1]


def test_fsdp2_reduce_scatter_can_be_subclassed_as_the_observer_does():
    base = torch_private.fsdp_default_reduce_scatter()
    assert callable(getattr(base, "allocate", None)) and "__call__" in vars(base)
    assert list(inspect.signature(base.allocate).parameters) == ["self", "size", "dtype", "device"]
    from torch.distributed.fsdp import FSDPModule

    assert hasattr(FSDPModule, "set_custom_reduce_scatter") and hasattr(FSDPModule, "set_all_reduce_hook")


def test_the_fake_backend_registers_and_makes_a_process_group():
    import torch.distributed as dist

    name = torch_private.register_fake_backend()
    assert not dist.is_initialized()
    dist.init_process_group(name, store=dist.HashStore(), rank=3, world_size=8)
    try:
        assert dist.get_world_size() == 8 and dist.get_rank() == 3
    finally:
        dist.destroy_process_group()


def test_fake_tensors_and_the_memory_trackers_are_there():
    with torch_private.fake_tensor_mode()():
        tensor = torch.empty(1024, 1024)
    assert type(tensor).__name__ == "FakeTensor"
    tracker, ref_types, state = torch_private.fsdp_mem_tracker()
    assert hasattr(ref_types, "INP") and hasattr(tracker, "_update_and_maybe_create_winfos")
    assert hasattr(tracker, "_fsdp_state_pre_forward") and hasattr(tracker, "_update_peak_stats")
    assert hasattr(torch_private.mem_tracker(), "_track_module_params_and_buffers") and state is not None


def test_torchruns_process_context_has_the_poll_the_agent_wraps():
    from torch.distributed.elastic.multiprocessing import api

    original = vars(api.MultiprocessContext).get("_poll")
    assert original is not None and list(inspect.signature(original).parameters) == ["self"]
    try:
        assert torch_private.wrap_multiprocess_poll(lambda poll: lambda context: poll(context), "checked")
        wrapped = vars(api.MultiprocessContext)["_poll"]
        assert wrapped is not original and getattr(wrapped, "checked")
        assert torch_private.wrap_multiprocess_poll(lambda poll: lambda context: None, "checked")   # once only
        assert vars(api.MultiprocessContext)["_poll"] is wrapped
    finally:
        setattr(api.MultiprocessContext, "_poll", original)
    # multiprocess_processes reads the context's torch.multiprocessing ProcessContext and its processes
    assert "self._pc = " in inspect.getsource(api.MultiprocessContext)
    assert "self.processes = " in inspect.getsource(torch.multiprocessing.ProcessContext.__init__)
    assert "error_files" in inspect.signature(api.PContext.__init__).parameters or \
        "error_files" in inspect.getsource(api.PContext.__init__)

    class Context:
        _pc = type("ProcessContext", (), {"processes": ["p0", "p1"]})()

    assert torch_private.multiprocess_processes(Context()) == ["p0", "p1"]      # type: ignore[arg-type]


def test_the_compiled_arch_list_reader_of_the_audit_is_there():
    """envcheck.torch_facts reads the arch list without initialising CUDA (torch._C._cuda_getArchFlags):
    envcheck sits below dflash, so it names the function in its child's code; this is its check."""
    from envcheck.torch_facts import CHILD_CODE

    assert "_cuda_getArchFlags" in CHILD_CODE
    if not torch.version.cuda:
        pytest.skip("a CPU build has no compiled CUDA arch list; the torch compat lane's CUDA wheel checks it")
    assert hasattr(torch._C, "_cuda_getArchFlags")


FLIGHT_RECORDER_RANK = textwrap.dedent("""
    import pickle, sys, torch, torch.distributed as dist
    from dflash.torch_private import flight_recorder_dump
    from dflash.train.supervisor.heartbeat import collectives_entered, flight_recorder_entries, recorder_backends
    dist.init_process_group("gloo", init_method=sys.argv[1], rank=int(sys.argv[2]), world_size=2)
    for _ in range(3):
        dist.all_reduce(torch.ones(2))
    dump = pickle.loads(flight_recorder_dump("gloo"))
    assert recorder_backends() == ("gloo",) and len(flight_recorder_entries()) == len(dump["entries"]) == 3
    print(collectives_entered(dump["entries"]))
    dist.destroy_process_group()
""")


def test_the_flight_recorder_counts_each_ranks_collectives_on_gloo(tmp_path):
    """The heartbeat's collective count (dflash.train.supervisor.heartbeat.collectives_entered) from torch's flight
    recorder, on two real gloo ranks with TORCH_FR_BUFFER_SIZE set as the launcher sets it."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    script = tmp_path / "rank.py"
    script.write_text(FLIGHT_RECORDER_RANK)
    env = {"TORCH_FR_BUFFER_SIZE": "100", "TORCH_NCCL_TRACE_BUFFER_SIZE": "100", "PYTHONPATH": str(REPO)}
    ranks = [subprocess.Popen([sys.executable, str(script), f"tcp://127.0.0.1:{port}", str(rank)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for rank in (0, 1)]
    outputs = [rank.communicate(timeout=120) for rank in ranks]
    for (out, err), rank in zip(outputs, ranks):
        assert rank.returncode == 0, err
        entered = eval(out.strip().splitlines()[-1])     # noqa: S307 - our own child's dict
        assert list(entered["collectives"].values()) == [3] and entered["last_collective"].startswith("gloo:all_reduce")


@pytest.mark.parametrize("backend", sorted(torch_private.FLIGHT_RECORDER_DUMPS))
def test_each_flight_recorder_dump_exists_with_the_arguments_used(backend):
    """The dump of the recorder each backend fills, with the keyword arguments flight_recorder_dump passes (read
    from pybind's signature line, then called). NCCL's is compiled into CUDA builds only: the suite's CPU torch
    has none and the dump answers None; the torch compat lane's CUDA wheel (2.9.1+cu128) must have it."""
    import pickle

    entry = getattr(torch._C._distributed_c10d, torch_private.FLIGHT_RECORDER_DUMPS[backend], None)
    if backend == "nccl" and not torch.version.cuda:
        assert entry is None and torch_private.flight_recorder_dump("nccl") is None
        return
    assert entry is not None, f"torch {torch.__version__} has no {torch_private.FLIGHT_RECORDER_DUMPS[backend]}"
    signature = (entry.__doc__ or "").splitlines()[0]
    assert all(f"{argument}:" in signature for argument in torch_private.FLIGHT_RECORDER_ARGUMENTS), signature
    dump = pickle.loads(torch_private.flight_recorder_dump(backend))
    assert isinstance(dump, dict) and "version" in dump, dump


@pytest.mark.parametrize("name", [n for n in dir(torch_private) if callable(getattr(torch_private, n))
                                  and not n.startswith("_") and getattr(getattr(torch_private, n), "__module__", "")
                                  == torch_private.__name__])
def test_every_function_of_the_module_is_checked_here(name):
    assert name in open(__file__, encoding="utf-8").read().replace("test_every_function", ""), \
        f"dflash.torch_private.{name} has no check in this file"
