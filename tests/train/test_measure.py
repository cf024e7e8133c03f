import torch

from lowmem_ft.train.measure import PeakMemory

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
