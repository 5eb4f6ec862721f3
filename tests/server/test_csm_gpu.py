"""On the GPU: the CUDA-graphed CSM frame step and Mimi decode equal the eager path."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def folder(tmp_path_factory):  # noqa: ANN001, ANN201
    from tiny_csm import tiny_csm

    d = tmp_path_factory.mktemp("csm_gpu")
    tiny_csm(d)
    return d


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_graphed_step_and_decode_equal_eager(folder, dtype) -> None:  # noqa: ANN001
    from realtime.tts_csm import CSMBackend

    eager = CSMBackend(str(folder), "cuda", "cuda", dtype, n_slots=4, max_seq_len=256, cuda_graphs=False)
    graphed = CSMBackend(str(folder), "cuda", "cuda", dtype, n_slots=4, max_seq_len=256, cuda_graphs=True)
    graphed.capture_graphs()
    texts = ["one two.", "three four five.", "six."]
    for b in (eager, graphed):
        for slot, t in enumerate(texts):
            b.csm.prefill(b.state, slot, b.csm.build_prompt(t, 0))
        b.decoder.reset()
    slots = torch.tensor([0, 1, 2])
    temp, top_k, seeds = torch.tensor([0.0, 0.9, 0.0]), torch.tensor([50, 50, 50]), torch.tensor([1, 2, 3])
    pcm_e, pcm_g = [], []
    for _ in range(20):
        ce = eager.frame_step(slots, temp, top_k, seeds)
        cg = graphed.frame_step(slots, temp, top_k, seeds)
        assert torch.equal(ce, cg)
        pcm_e.append(eager.decode_slots(slots, ce[:, :, None]).float().cpu())
        pcm_g.append(graphed.decode_slots(slots, cg[:, :, None]).float().cpu())
    a, b = torch.cat(pcm_e, -1).numpy(), torch.cat(pcm_g, -1).numpy()
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert np.abs(a - b).max() <= tol * max(1.0, np.abs(a).max())
