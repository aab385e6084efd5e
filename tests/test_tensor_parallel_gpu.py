"""The NCCL communicator on a real GPU, through cupy.cuda.nccl: one rank (a machine with one GPU can
run no more: NCCL refuses two ranks on one device). The multi-GPU run is issue 27's."""
import numpy as np

from gpu_skip import cupy_with_a_device
from hf_models import llama_config, save_random_model

cp = cupy_with_a_device()

import minillm                                                              # noqa: E402
from minillm.cuda.device_model import to_device                             # noqa: E402
from minillm.engine.parallel.communicator import NCCLCommunicator, SingleProcess   # noqa: E402


def test_nccl_collectives_on_cupy_arrays():
    comm = NCCLCommunicator(SingleProcess())
    assert comm.all_reduce(cp.arange(6, dtype=cp.float32)).get().tolist() == list(range(6))
    assert comm.all_gather(cp.ones(3, dtype=cp.float16)).get().tolist() == [[1.0] * 3]
    assert comm.broadcast(cp.full(2, 7, dtype=cp.int64)).get().tolist() == [7, 7]
    assert comm.broadcast_object({"a": 1}) == {"a": 1}
    comm.barrier()


def test_the_device_model_all_reduces_through_nccl(tmp_path):
    save_random_model(llama_config(), tmp_path)
    ids = [3, 17, 99, 250, 5, 7, 300, 42]
    cpu = minillm.load(tmp_path)
    model = cpu.model.with_options()
    model.comm = NCCLCommunicator(SingleProcess())       # size 1: the all-reduces run, the vocab split does not
    gpu = to_device(model, "float32", cache_dtype="float32")
    got = gpu.prefill(ids, gpu.new_cache(len(ids)), all_logits=True)
    assert np.abs(got - cpu.logits(ids)).max() < 1e-4
    assert model.comm.stats.calls["all_reduce"] == 2 * 3                 # two a layer, 3 layers
