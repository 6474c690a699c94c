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
