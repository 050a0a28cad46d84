"""Activation ranges of a BF16 checkpoint, for NVFP4's static ``input_scale`` (calibration).

SGLang's W4A4 NVFP4 path quantizes every activation with a static per-tensor scale from the
checkpoint (``engine.model.act_nvfp4``), so the conversion calibrates it as NVIDIA ModelOpt does
with its default ``max`` calibrator: run the BF16 model on calibration text, keep the largest
``|x|`` seen at each quantized linear's input, and export ``input_scale = amax / (6 * 448)``
(``weight_sync.formats.nvfp4.input_scale``).

Data: ``CALIBRATION_TEXT`` below (fixed, part of the code: no data set, no download), encoded with
the checkpoint's own ``tokenizer.json`` and cut into sequences of ``SEQ_LEN`` tokens, each run from
an empty cache. The forward is this engine's BF16 forward (``engine.model.model``, float32
arithmetic on the BF16 weights), observed at every projection's input before any quantization.
The same checkpoint gives the same ranges on the same machine (a max is exact; the GEMMs are
deterministic for a given build and thread count); a version is converted once and every replica
loads those bytes.

Sites: q/k/v share their input (one range), as do a dense MLP's gate and up; the experts' gate/up
input and their down input each get one range per MoE layer, over all routed rows. That is also
what SGLang's default Blackwell MoE backend computes with (``w13_input_scale.max()`` and
``w2_input_scale.max()`` over the experts, ``layers/quantization/modelopt_quant.py`` 2768-2770);
ModelOpt would export each expert's own range, whose maximum is this one.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from engine.model.model import load_model
from engine.model.tokenizer import Tokenizer

SEQ_LEN = 256

# Prose, code, numbers, markup and a few other scripts, so that calibration sees the kinds of
# tokens a policy reads and writes. Changing it changes every converted NVFP4 checkpoint.
CALIBRATION_TEXT = """\
The river had been rising for three days when the ferryman finally tied his boat to the old oak \
and walked up the hill to warn the village. Nobody believed him at first: the sky was clear, the \
wind was calm, and the water looked no different from the spring before. By evening, though, the \
lower fields were gone, and the miller was carrying sacks of flour up to the church loft.

Q: A train leaves at 09:45 and arrives at 13:20. How long is the journey?
A: From 09:45 to 13:45 is 4 hours; 13:20 is 25 minutes earlier, so the journey takes 3 h 35 min.

def moving_average(values, window=3):
    \"\"\"Return the mean of each run of `window` consecutive values.\"\"\"
    if window <= 0:
        raise ValueError(f"window must be positive, got {window}")
    return [sum(values[i:i + window]) / window for i in range(len(values) - window + 1)]

{"id": 4172, "name": "sensor-7", "readings": [21.4, 21.9, -3.25, 1e-3, 640], "ok": true}

| year | revenue (M$) | growth |
|------|--------------|--------|
| 2021 | 118.2        | +12.5% |
| 2022 | 131.9        | +11.6% |

Let x = 2 and y = x^3 - 4x + 1 = 8 - 8 + 1 = 1; then the slope 3x^2 - 4 equals 8 at that point.
SELECT name, COUNT(*) FROM orders WHERE created_at >= '2024-01-01' GROUP BY name ORDER BY 2 DESC;
Le renard brun saute par-dessus le chien paresseux. Der schnelle braune Fuchs springt über den \
faulen Hund. 敏捷的棕色狐狸跳过了懒狗。 Быстрая коричневая лиса перепрыгивает через ленивую собаку.
Step 1: read the question carefully. Step 2: write down what is known. Step 3: check the answer \
against the question before you submit it, because a correct method with a wrong reading still \
gives a wrong result.
"""


def calibration_ids(path: str | Path) -> list[torch.Tensor]:
    """``CALIBRATION_TEXT`` in the tokens of ``path``'s ``tokenizer.json``, as sequences of at most
    ``SEQ_LEN`` ids (``ValueError`` if the directory has no readable tokenizer)."""
    ids = Tokenizer.from_dir(path).encode(CALIBRATION_TEXT)
    if not ids:
        raise ValueError(f"{path}: the tokenizer encodes the calibration text as no tokens")
    return [torch.tensor(ids[i : i + SEQ_LEN]) for i in range(0, len(ids), SEQ_LEN)]


def input_amax(path: str | Path) -> dict[tuple[int, str], float]:
    """``{(layer, site): max |x|}`` over the calibration text, for every quantizable input of the
    BF16 checkpoint at ``path`` (``site`` in ``engine.model.model.SITES``; a layer has the sites
    of its kind). ``ValueError`` names a checkpoint the engine cannot load, a missing tokenizer, or
    a range that is not finite."""
    amax: dict[tuple[int, str], float] = {}

    def observe(layer: int, site: str, x: torch.Tensor) -> None:
        top = float(x.abs().max()) if x.numel() else 0.0
        key = (layer, site)
        amax[key] = top if math.isnan(top) else max(amax.get(key, 0.0), top)  # a NaN stays

    sequences = calibration_ids(path)
    model = load_model(path, observer=observe)
    vocab = model.vocab_size
    for ids in sequences:
        if int(ids.max()) >= vocab:
            raise ValueError(
                f"{path}: the tokenizer yields id {int(ids.max())}, outside the vocabulary {vocab}"
            )
        model.forward([ids], [model.new_sequence()])
    for (layer, site), v in amax.items():
        if not math.isfinite(v):
            raise ValueError(f"{path}: layer {layer} {site} input reached {v} on the calibration text")
    return amax
