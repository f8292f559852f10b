"""One measurement of a PyTorch step (plain or Opacus) in this process; prints one JSON line.

Run by ``benchmarks/peers.py`` with the peers virtualenv's interpreter, e.g.::

    /work/venv-peers/bin/python -m benchmarks.peers_run_torch --framework opacus \
        --workload cnn-small --physical 64 --logical 128 --noise-multiplier 1.0

``--framework torch`` is the non-private step (one batched backward per micro-batch,
gradients summed, one SGD update). ``opacus`` wraps the same model in Opacus's
``GradSampleModule`` + ``DPOptimizer`` (per-sample gradients by module hooks, functorch for
the WS convolutions), accumulating micro-batches with ``signal_skip_step`` and adding the
noise once per logical batch. ``opacus-plainconv`` is the same with plain convolutions
(not dpscale's architecture: it isolates the cost of the functorch fallback). ``opacus-ghost`` uses Opacus's ghost clipping (norms without
per-sample gradients, then a second, weighted backward): its best mode for linear layers.

On a machine with CUDA the step runs on the GPU (``--device auto``, the default) and every
timed call ends with ``torch.cuda.synchronize()``, so the wall time is the GPU's work.
"""

from __future__ import annotations

from benchmarks.peers_measure import emit, measure, parse_runner_args, rss_now_mb


def main() -> None:
    args = parse_runner_args(("torch", "opacus", "opacus-ghost", "opacus-plainconv"))
    base = rss_now_mb()
    import torch
    from torch import nn

    from benchmarks.peers_torch import build, without_weight_standardisation

    torch.manual_seed(0)
    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    model, shape = build(args.workload)
    if args.framework == "opacus-plainconv":
        model = without_weight_standardisation(model)
    model = model.to(device)
    micro = args.logical // args.physical
    batches = [
        (torch.randn(args.physical, *shape, device=device), torch.randint(0, 10, (args.physical,), device=device))
        for _ in range(micro)
    ]
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    criterion = nn.CrossEntropyLoss()
    extra = {"torch": torch.__version__, "threads": torch.get_num_threads(), "device": device}
    if device == "cuda":
        extra["gpu"] = torch.cuda.get_device_name()

    if args.framework == "torch":

        def step() -> None:
            for x, y in batches:
                (criterion(model(x), y) * (args.physical / args.logical)).backward()
            sgd.step()
            sgd.zero_grad(set_to_none=True)
    elif args.framework in ("opacus", "opacus-plainconv"):
        import opacus
        from opacus import GradSampleModule
        from opacus.optimizers import DPOptimizer

        extra["opacus"] = opacus.__version__
        gsm = GradSampleModule(model)
        dp = DPOptimizer(
            sgd, noise_multiplier=args.noise_multiplier, max_grad_norm=1.0, expected_batch_size=args.logical
        )

        def step() -> None:
            for index, (x, y) in enumerate(batches):
                criterion(gsm(x), y).backward()
                if index < micro - 1:
                    dp.signal_skip_step(do_skip=True)
                dp.step()
                dp.zero_grad(set_to_none=True)
    else:
        import opacus
        from opacus.grad_sample import GradSampleModuleFastGradientClipping
        from opacus.optimizers import DPOptimizerFastGradientClipping
        from opacus.utils.fast_gradient_clipping_utils import DPLossFastGradientClipping

        extra["opacus"] = opacus.__version__
        gsm = GradSampleModuleFastGradientClipping(model, max_grad_norm=1.0, use_ghost_clipping=True)
        dp = DPOptimizerFastGradientClipping(
            sgd, noise_multiplier=args.noise_multiplier, max_grad_norm=1.0, expected_batch_size=args.logical
        )
        dp_loss = DPLossFastGradientClipping(gsm, dp, criterion, loss_reduction="mean")
        if micro != 1:
            raise SystemExit("opacus-ghost is measured with logical == physical only")

        def step() -> None:
            x, y = batches[0]
            dp_loss(gsm(x), y).backward()
            dp.step()
            dp.zero_grad(set_to_none=True)

    if device == "cuda":
        unsynchronised = step

        def step() -> None:  # the GPU's work, not only its launch
            unsynchronised()
            torch.cuda.synchronize()

    result = measure(
        step, examples=args.logical, warmup=args.warmup, repeats=args.repeats, rss_base_mb=base, extra=extra
    )
    if device == "cuda":
        result["peak_gpu_memory_mb"] = torch.cuda.max_memory_allocated() / 2**20
    emit(result)


if __name__ == "__main__":
    main()
