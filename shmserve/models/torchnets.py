"""Small torch models for the torch backend's tests and the GPU check (imports torch when called).

* ``convnet()``: a small convolutional classifier with seeded random weights.
* ``demo_as_torch()``: the embedded ONNX demo model rebuilt in torch with the
  same weights (needs the ``onnx`` package to read them).
* ``save_models(directory)``: writes TorchScript (``.pt``) and torch.export
  (``.pt2``, dynamic batch) files of both; returns their paths.
"""

from __future__ import annotations

from pathlib import Path


def convnet():
    import torch
    from torch import nn

    torch.manual_seed(20261129)
    return nn.Sequential(
        nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(), nn.Conv2d(32, 64, 3, stride=2, padding=1), nn.ReLU(),
        nn.Conv2d(64, 64, 3, stride=2, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
        nn.Linear(64, 10)).eval()


def demo_as_torch():
    import onnx
    import torch
    from onnx import numpy_helper
    from torch import nn

    from shmserve.config import demo_config

    weights = {t.name: torch.from_numpy(numpy_helper.to_array(t).copy())
               for t in onnx.load(demo_config().models[0].path).graph.initializer}

    class Demo(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv1, self.conv2 = nn.Conv2d(3, 16, 3, padding=1), nn.Conv2d(16, 32, 3, padding=1)
            self.fc = nn.Linear(32, 10)
            with torch.no_grad():
                self.conv1.weight.copy_(weights["conv1_w"])
                self.conv1.bias.copy_(weights["conv1_b"])
                self.conv2.weight.copy_(weights["conv2_w"])
                self.conv2.bias.copy_(weights["conv2_b"])
                self.fc.weight.copy_(weights["fc_w"].T)
                self.fc.bias.copy_(weights["fc_b"])

        def forward(self, image):
            x = torch.max_pool2d(torch.relu(self.conv1(image)), 2)
            x = torch.relu(self.conv2(x)).mean(dim=(2, 3))
            return torch.softmax(self.fc(x), dim=1)

    return Demo().eval()


def save_models(directory: str | Path, *, with_demo: bool = False) -> dict[str, str]:
    import torch

    directory = Path(directory)
    example = torch.zeros(2, 3, 32, 32)
    models = {"": convnet()}
    if with_demo:
        models["demo_"] = demo_as_torch()
    paths = {}
    for prefix, model in models.items():
        ts = directory / f"{prefix}convnet.pt" if not prefix else directory / f"{prefix}model.pt"
        torch.jit.trace(model, example).save(str(ts))
        batch = torch.export.Dim("batch", min=1, max=4096)
        program = torch.export.export(model, (example,), dynamic_shapes=({0: batch},))
        pt2 = ts.with_suffix(".pt2")
        torch.export.save(program, str(pt2))
        paths[f"{prefix}torchscript"], paths[f"{prefix}export"] = str(ts), str(pt2)
    return paths
