"""The user-facing DSpark switches that need no model run: the request field and the generator's
flags (a draft width other than the checkpoint's block is refused before anything loads)."""

import pytest

from scripts import generate as generate_script
from tests.engine_common import build_model
from v41_jax.runtime.request_parse import RequestError, parse_request


def test_request_field():
    assert parse_request({"prompt_ids": [5], "speculative": False}, vocab_size=10).speculative is False
    assert parse_request({"prompt_ids": [5], "speculative": True}, vocab_size=10).speculative is True
    assert parse_request({"prompt_ids": [5]}, vocab_size=10).speculative is None     # the engine's default
    with pytest.raises(RequestError, match="speculative"):
        parse_request({"prompt_ids": [5], "speculative": 0}, vocab_size=10)


@pytest.mark.parametrize("flags,message", [
    (["--draft-width", "3"], "--draft-width: draft width 3: this checkpoint drafts blocks of 4"),
    (["--speculative", "maybe"], "invalid choice"),
])
def test_generator_flags_refused_before_loading(tmp_path, capsys, monkeypatch, flags, message):
    build_model(tmp_path / "ckpt", "tiny", seed=0)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt_ids": [5, 6]}\n')
    monkeypatch.setattr("v41_jax.checkpoint.load.load_params", lambda *a, **k: pytest.fail("loaded"))
    try:
        rc = generate_script.main(["--checkpoint", str(tmp_path / "ckpt"), "--prompts", str(prompts), *flags])
    except SystemExit as e:
        rc = e.code
    assert rc == 2 and message in capsys.readouterr().err
