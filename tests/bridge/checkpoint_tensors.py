"""Compare the tensors of two ``torch_dist`` checkpoints bit for bit (run with the Bridge
environment's Python: ``python checkpoint_tensors.py DIR_A DIR_B``; prints one JSON line).

Reads each checkpoint directory (``.../iter_0000006``) with PyTorch's distributed-checkpoint
reader into plain tensors (``dcp_to_torch_save``), then compares every tensor of the model and
the optimizer (fp32 main parameters, Adam moments) by ``torch.equal``: ``missing`` lists the
keys in one only (or of different shapes), ``different`` those whose values differ, with the
largest difference relative to the tensor's largest magnitude and the count of differing elements."""
import json
import os
import sys
import tempfile

import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save


def tensors(ckpt_dir: str) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "ckpt.pt")
        dcp_to_torch_save(ckpt_dir, out)
        state = torch.load(out, weights_only=False)
    flat = {}

    def walk(prefix, value):
        if isinstance(value, torch.Tensor):
            flat[prefix] = value
        elif isinstance(value, dict):
            for k, v in value.items():
                walk(f"{prefix}/{k}" if prefix else str(k), v)
        elif isinstance(value, (list, tuple)):
            for i, v in enumerate(value):
                walk(f"{prefix}/{i}", v)

    walk("", state)
    return flat


def main(a: str, b: str) -> None:
    ta, tb = tensors(a), tensors(b)
    missing = sorted(set(ta) ^ set(tb)) + sorted(k for k in set(ta) & set(tb) if ta[k].shape != tb[k].shape)
    common = [k for k in set(ta) & set(tb) if k not in missing]
    different = sorted(k for k in common if not torch.equal(ta[k], tb[k]))
    # the largest difference relative to the tensor's own magnitude (floating-point tensors)
    worst = 0.0
    for k in different:
        x, y = ta[k].double(), tb[k].double()
        scale = float(x.abs().max())
        worst = max(worst, float((x - y).abs().max()) / (scale if scale > 0 else 1.0))
    print(json.dumps({"tensors": len(ta), "elements": int(sum(t.numel() for t in ta.values())),
                      "missing": missing, "different": different, "max_rel_diff": worst,
                      "differing_elements": int(sum(int((ta[k] != tb[k]).sum()) for k in different))}))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
