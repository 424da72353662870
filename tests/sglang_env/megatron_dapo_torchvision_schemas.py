"""Lets PyPI's torchvision 0.28.0 import beside the CPU torch 2.13.0 of the test venv (loaded by a .pth).

Why: SGLang imports `torchvision.transforms` unconditionally (sglang/srt/configs -> nano_nemotron_vl ->
srt/multimodal/internvl_utils.py). PyPI's torchvision wheel is linked against CUDA torch, so its `_C`
extension does not load here and its ops are never defined; `torchvision/_meta_registrations.py` then
calls `torch.library.register_fake("torchvision::nms")` (and `qnms`) on operators that do not exist and
the import fails. This hook defines the two operator schemas, with no kernel, just before torchvision is
first imported, so the fake registration finds them. SGLang's text models never call them; a call would
fail with torch's "no kernel" error. Nothing imports torch until torchvision is imported.
"""

import importlib.abc
import sys

_SCHEMAS = ("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
            "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")


class _DefineTorchvisionSchemas(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        if fullname != "torchvision":
            return None
        sys.meta_path.remove(self)  # once: defining the schemas twice is an error
        import torch

        if not hasattr(torch.ops.torchvision, "nms"):
            lib = torch.library.Library("torchvision", "FRAGMENT")
            for schema in _SCHEMAS:
                lib.define(schema)
            sys.modules[__name__]._library = lib  # keep the registration alive
        return None  # the normal finders import torchvision itself


def install() -> None:
    if not any(isinstance(f, _DefineTorchvisionSchemas) for f in sys.meta_path):
        sys.meta_path.insert(0, _DefineTorchvisionSchemas())
