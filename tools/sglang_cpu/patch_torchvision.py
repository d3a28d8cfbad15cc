"""Make PyPI's CUDA-built torchvision 0.28 importable beside CPU torch 2.13 (idempotent).

Its C operators do not load there, and ``torchvision/_meta_registrations.py`` registers
two fake kernels (``torchvision::nms`` / ``qnms``) without checking, which raises
``operator torchvision::nms does not exist`` at import. SGLang imports torchvision
unconditionally, so both decorators are made conditional on
``torchvision.extension._has_ops()`` (as the file's other registrations already are).

Usage: ``python patch_torchvision.py SITE_PACKAGES_DIR``; exit 0 when patched or already
patched, 1 when the file does not look as expected.
"""
from __future__ import annotations

import sys
from pathlib import Path

GUARD = ("_kvgate_fake = (lambda name: torch.library.register_fake(name)\n"
         "                if torchvision.extension._has_ops() else (lambda f: f))\n")
OPS = ("torchvision::nms", "torchvision::qnms")


def patch(text: str) -> str:
    if GUARD in text:
        return text
    for op in OPS:
        old = f'@torch.library.register_fake("{op}")'
        if text.count(old) != 1:
            raise ValueError(f"expected one {old!r}")
        text = text.replace(old, f'@_kvgate_fake("{op}")')
    anchor = "import torchvision.extension  # noqa: F401\n"
    if anchor not in text:
        raise ValueError(f"expected {anchor!r}")
    return text.replace(anchor, anchor + GUARD, 1)


def main(argv: list[str]) -> int:
    path = Path(argv[1]) / "torchvision" / "_meta_registrations.py"
    try:
        path.write_text(patch(path.read_text()))
    except (OSError, ValueError) as e:
        print(f"patch_torchvision: {path}: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
