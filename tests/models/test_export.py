"""`kvstate.models.gguf.export_mlx_lm`: the GGUF model as a directory mlx-lm itself loads."""

import mlx.core as mx
import pytest

from kvstate.models import gguf
from kvstate.models import load as models


@pytest.mark.slow
def test_mlx_lm_loads_the_export_and_gives_the_same_greedy_tokens(tmp_path, smollm):
    import mlx_lm

    out = gguf.export_mlx_lm(models.fetch(), tmp_path / "m")
    theirs, tok = mlx_lm.load(str(out))
    ours = smollm  # models.load_model of the same file, dequantized
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = ours.tokenizer.chat(msgs)
    assert list(tok.apply_chat_template(msgs, add_generation_prompt=True)) == prompt
    assert tuple(tok.eos_token_ids) == ours.tokenizer.eos_ids

    def greedy(model, n=8):
        x, out = mx.array([prompt]), []
        from mlx_lm.models.cache import make_prompt_cache

        cache = make_prompt_cache(model)
        for _ in range(n):
            t = mx.argmax(model(x, cache=cache)[:, -1, :], axis=-1)
            out.append(t.item())
            x = t[:, None]
        return out

    want = greedy(ours.model)
    assert greedy(theirs) == want
    assert "Paris" in ours.tokenizer.decode(want)
