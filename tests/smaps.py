"""What Linux says about the mapping that holds a tensor (``/proc/self/smaps``)."""

from __future__ import annotations

from pathlib import Path

import torch


def mapping_fields(tensor: torch.Tensor) -> dict[str, list[str]]:
    """The smaps fields of the mapping that holds ``tensor``'s first byte: ``VmFlags`` (the kernel's flags,
    ``hg`` for ``MADV_HUGEPAGE``), ``AnonHugePages`` and the others, each split into words."""
    address, fields, inside = tensor.data_ptr(), None, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        first, _, rest = line.partition(" ")
        if "-" in first and not first.endswith(":"):
            start, end = (int(part, 16) for part in first.split("-"))
            inside = start <= address < end
            fields = {} if inside else fields
        elif inside and fields is not None:
            fields[first.rstrip(":")] = rest.split()
    assert fields is not None, "no mapping holds the tensor"
    return fields
