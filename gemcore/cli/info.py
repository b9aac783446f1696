"""``gem info``: versions, GPUs, and which plugins and backends are usable here."""
from __future__ import annotations

import argparse
import importlib.metadata as md
import platform

from gemcore.cli.common import add_config_arguments, load_from_args
from gemcore.cli.plugins import describe


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_config_arguments(p)


def _version(dist: str) -> str:
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return "not installed"


def _mpi_library() -> str:
    try:
        from mpi4py import MPI

        return MPI.Get_library_version().splitlines()[0].strip()
    except Exception as exc:  # noqa: BLE001 - report, never fail
        return f"unavailable ({type(exc).__name__})"


def versions() -> dict[str, str]:
    cupy = next((v for v in (_version(d) for d in ("cupy-cuda13x", "cupy-cuda12x", "cupy"))
                 if v != "not installed"), "not installed")
    return {"python": platform.python_version(), "gemcore": _version("gemcore"), "torch": _version("torch"),
            "triton": _version("triton"), "pluggy": _version("pluggy"), "mpi4py": _version("mpi4py"),
            "MPI library": _mpi_library() if _version("mpi4py") != "not installed" else "n/a",
            "cupy": cupy}


def gpus() -> list[str]:
    import torch

    if not torch.cuda.is_available():
        return []
    return [f"cuda:{i} {torch.cuda.get_device_name(i)} "
            f"({torch.cuda.get_device_properties(i).total_memory / 2**30:.0f} GiB)"
            for i in range(torch.cuda.device_count())]


def training_carriers(manager) -> dict[str, str]:
    """``{comms.backend: what carries FSDP2/TP/CP/EP/PP traffic under it}`` for every backend offered."""
    from gemcore.comms.process_group import SERVED_DEVICES, backend_name

    out = {"none": "torch.distributed's own: nccl (cuda), gloo (cpu)",
           "torch": "torch.distributed's own: nccl (cuda), gloo (cpu)"}
    for impl in manager.implementations("communication").values():
        if impl.name in ("torch", "single", "auto"):
            continue
        devices = ", ".join(SERVED_DEVICES.get(impl.name, ("cpu", "cuda")))
        out[impl.name] = f"{backend_name(impl.name)} ({devices})"
    out["auto"] = "single for one process, else as torch (mpi under mpirun on CPU)"
    return out


def _print_low_precision() -> None:
    """What each GPU generation gets for low-precision training, and the fp8_block GEMM backends here."""
    import torch

    from gemcore.kernels import fp8_block

    here = {fp8_block.generation_of(torch.cuda.get_device_capability(i)) for i in range(torch.cuda.device_count())} \
        if torch.cuda.is_available() else set()
    print("low precision by GPU generation (compute capability):")
    for cap, name, routes in fp8_block.generation_routes():
        mark = " (this machine)" if any(f"{c[0]}.{c[1]}" == cap for c in here) else ""
        print(f"  {cap:5s} {name}{mark}: {routes}")
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    status = fp8_block.matmul_backend_status(device)
    print("  fp8_block GEMM backends here: " + ", ".join(
        name if reason is None else f"{name} (unusable: {reason})" for name, reason in status.items()))


def run(args: argparse.Namespace) -> int:
    config, manager = load_from_args(args)
    print("versions:")
    for k, v in versions().items():
        print(f"  {k:12s} {v}")
    found = gpus()
    print("GPUs:" + ("" if found else " none (CPU only)"))
    for g in found:
        print(f"  {g}")
    _print_low_precision()
    print("implementations:")
    from gemcore.plugin_manager import HOOK_POINTS

    for point in HOOK_POINTS:
        shown = []
        for impl in manager.implementations(point).values():
            check = getattr(impl.factory, "unavailable", None)
            reason = check() if callable(check) else None
            shown.append(impl.name if reason is None else f"{impl.name} (unusable here: {reason})")
        print(f"  {point:13s} {', '.join(shown) or 'none'}")
    print("training traffic (comms.backend -> the torch.distributed backend carrying every mesh dimension):")
    for name, line in training_carriers(manager).items():
        print(f"  {name:8s} {line}")
    info = describe(config, manager)
    for p in info["plugins"]:
        if p["status"] == "failed":
            print(f"  plugin {p['name']} unusable: {p['error']}")
        elif p["status"] == "disabled":
            print(f"  plugin {p['name']} disabled by configuration")
    return 0
