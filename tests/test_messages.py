"""Request bodies as clients write them."""

from __future__ import annotations

import pytest

from edged.errors import BadInput
from edged.messages import parse_json, speech_body


def test_a_body_may_start_with_a_byte_order_mark() -> None:
    # PowerShell and Notepad write one; it was a 400 with Python's "decode using utf-8-sig" advice.
    assert parse_json(b'\xef\xbb\xbf{"text": "Hi."}') == {"text": "Hi."}
    with pytest.raises(BadInput, match="malformed JSON"):
        parse_json(b'{"text": "Hi."}\xef\xbb\xbf')  # elsewhere it is still no JSON


def test_an_empty_openai_voice_is_called_empty_not_missing() -> None:
    with pytest.raises(BadInput, match="field 'voice' is empty"):
        speech_body({"input": "Hi.", "voice": ""}, 100)
    with pytest.raises(BadInput, match="missing field 'voice'"):
        speech_body({"input": "Hi."}, 100)


def test_an_openai_voice_may_be_a_custom_voice_object() -> None:
    # OpenAI's SDKs send a custom voice as {"id": ...}; it was "field 'voice' must be a string".
    assert speech_body({"input": "Hi.", "voice": {"id": "en_US-joe-medium"}}, 100).voice == "en_US-joe-medium"
    for bad in [{"id": 3}, {"name": "x"}, {"id": "x", "extra": 1}, {}, [], 3]:
        with pytest.raises(BadInput, match="field 'voice' must be a string"):
            speech_body({"input": "Hi.", "voice": bad}, 100)
    with pytest.raises(BadInput, match="field 'voice' is empty"):
        speech_body({"input": "Hi.", "voice": {"id": ""}}, 100)
