import pytest
import torch

from lowmem_ft.train.measure.peak import PeakMemory

MB = 1_000_000


def test_counts_existing_new_and_freed_storages():
    before = torch.zeros(250_000)  # 1 MB that exists before the tracker starts
    with PeakMemory(device="cpu") as pm:
        start = pm.live_bytes
        a = torch.ones(500_000)  # +2 MB
        b = a * 2  # +2 MB
        view = a.view(-1)  # a view shares a's storage: +0
        del b  # −2 MB
        pm.mark("after")
    assert start >= before.numel() * 4
    assert pm.peak_bytes - start == 4 * MB
    assert pm.live_bytes - start == 2 * MB
    assert pm.marks[0].peak_bytes - start == 4 * MB
    assert view.numel() == a.numel()


def test_sees_backward_gradients():
    x = torch.randn(1000, requires_grad=True)
    with PeakMemory(device="cpu") as pm:
        start = pm.live_bytes
        (x * x).sum().backward()
    assert x.grad is not None
    assert pm.live_bytes - start >= x.numel() * 4  # the gradient stays alive


def test_window_gives_the_peak_since_the_previous_window():
    with PeakMemory(device="cpu") as pm:
        start, _ = pm.window()
        a = torch.ones(250_000)  # +1 MB
        b = torch.ones(250_000)  # +1 MB
        del a, b
        live, peak = pm.window()
        assert (live - start, peak - start) == (0, 2 * MB)
        c = torch.ones(250_000)
        live, peak = pm.window()
        assert (live - start, peak - start) == (MB, MB)  # the earlier 2 MB no longer counts
    assert c.numel()


def test_roots_count_what_a_run_holds_and_nothing_else():
    """Tensors reachable from the roots (parameters, tensors held in attributes, optimizer states keyed by
    parameter, gradients) are counted; a tensor alive elsewhere in the process (an earlier run) is not."""
    elsewhere = torch.zeros(1_000_000)  # 4 MB the run does not hold
    layer = torch.nn.Linear(100, 100, bias=False)  # 40 kB
    layer.constants = torch.zeros(2_500)  # 10 kB held as a plain attribute (like bitsandbytes' quant_state)
    layer.weight.grad = torch.zeros(100, 100)  # 40 kB
    optimizer = torch.optim.AdamW(layer.parameters())
    optimizer.step()  # exp_avg, exp_avg_sq: 80 kB, plus the step count
    with PeakMemory(device="cpu", roots=[layer, optimizer.state]) as pm:
        held = pm.live_bytes
    assert 170_000 <= held < 171_000
    assert elsewhere.numel()


def test_freed_storages_are_forgotten():
    """A long run frees millions of tensors: the tracker keeps nothing of a freed one."""
    with PeakMemory(device="cpu") as pm:
        start = len(pm._live)
        for _ in range(1000):
            (torch.ones(10) * 2).sum()
        assert len(pm._live) - start < 10
        assert pm.live_bytes < pm.peak_bytes


def test_bitsandbytes_cpu_optimizer_kernels_are_counted():
    """bitsandbytes' CPU optimizer step is a custom op whose kernel is Python: PeakMemory runs the same function with
    its torch ops in view, so its fp32 copies count (6 of a bf16 tensor with 8-bit states, 4 with 32-bit states;
    counted one by one in backends/cpu/ops.py) — without it the step would look like it allocated nothing."""
    bnb = pytest.importorskip("bitsandbytes")
    n = 100_000
    for min_8bit, copies in ((4096, 6), (10**9, 4)):
        param = torch.nn.Parameter(torch.randn(n, dtype=torch.bfloat16))
        param.grad = torch.randn(n, dtype=torch.bfloat16)
        # bitsandbytes keeps overrides process-wide by parameter position (GlobalOptimManager.index2config): a
        # Trainer run earlier in this process leaves its embeddings' 32-bit override at their position
        bnb.optim.GlobalOptimManager.get_instance().initialize()
        optimizer = bnb.optim.AdamW8bit([param], min_8bit_size=min_8bit)
        optimizer.step()  # the states exist before the measured step
        with PeakMemory(device="cpu", roots=[param, optimizer.state]) as pm:
            before = pm.live_bytes
            optimizer.step()
        assert pm.peak_bytes - before == pytest.approx(copies * 4 * n, rel=0.01)


def test_storage_resizes_are_counted_when_asked():
    # FSDP2 gathers a unit by growing its parameters' storages in place (`alloc_storage` / `free_storage`), which
    # no dispatch mode sees; `storage_resizes` counts them, and `resize_` is torch's own again afterwards
    original = torch.UntypedStorage.resize_
    t = torch.empty(0)
    with PeakMemory(device="cpu", storage_resizes=True) as pm:
        start = pm.live_bytes
        t.untyped_storage().resize_(2 * MB)
        grown = pm.live_bytes - start
        t.untyped_storage().resize_(0)
    assert grown == 2 * MB
    assert pm.peak_bytes - start == 2 * MB and pm.live_bytes == start
    assert torch.UntypedStorage.resize_ is original


def test_wrapper_tensors_count_their_inner_storage():
    from torch.testing._internal.two_tensor import TwoTensor

    with PeakMemory(device="cpu") as pm:
        start = pm.live_bytes
        pair = TwoTensor(torch.ones(250_000), torch.ones(250_000))  # a wrapper of two 1 MB tensors, as a DTensor
        doubled = pair * 2  # runs below the mode on the inner tensors; the wrapper it returns holds 2 MB
    assert doubled.a.numel() == 250_000
    assert pm.live_bytes - start == 4 * MB
