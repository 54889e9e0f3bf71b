"""lowrank's calibration text: a share of number-bearing HotpotQA paragraphs (`calibration_text(numbers=)`), what
`hf-kvcompress calibrate` fits on and records, and what the error curves and copy weights read again."""

import pytest

from hf_kvcompress.calibration import (
    CALIBRATION_TEXT,
    LONG_NUMBER,
    LOWRANK_NUMBERS,
    bases_numbers,
    calibration_name,
    calibration_text,
)
from hf_kvcompress.eval.data import hotpotqa_questions


def _words(paragraphs):
    return sum(len(p.split()) for p in paragraphs)


def test_no_share_is_the_last_paragraphs_as_before():
    _, paragraphs = hotpotqa_questions()
    picked, count = [], 0
    for paragraph in reversed(paragraphs):  # the text before the share existed: the last paragraphs, last first
        picked.append(paragraph)
        count += len(paragraph.split())
        if count >= 3000:
            break
    assert calibration_text(words=3000) == calibration_text(words=3000, numbers=0.0) == "\n\n".join(picked)


@pytest.mark.parametrize("share", [0.25, 0.5])
def test_a_share_of_the_words_comes_from_number_bearing_paragraphs(share):
    _, paragraphs = hotpotqa_questions()
    plain = calibration_text(words=4000)
    text = calibration_text(words=4000, numbers=share)
    known = set(paragraphs)
    picked = [p for p in paragraphs if p in text]  # whole paragraphs, each at most once
    assert len(picked) == len(set(picked)) and all(text.count(p) == 1 for p in picked if p in known)
    numbered = [p for p in picked if LONG_NUMBER.search(p)]
    assert share - 0.1 < _words(numbered) / _words(picked) < share + 0.1
    assert len(LONG_NUMBER.findall(text)) > 2 * len(LONG_NUMBER.findall(plain))
    assert len(text.split()) >= 4000


@pytest.mark.parametrize("bad", [-0.1, 1.5, True, "half"])
def test_a_bad_share_is_refused(bad):
    with pytest.raises(ValueError, match="numbers must be a share in"):
        calibration_text(words=100, numbers=bad)


def test_the_files_name_the_text_and_its_share():
    assert calibration_name(0.0) == CALIBRATION_TEXT
    assert "0.5 of the words from paragraphs holding a number of 5+ digits" in calibration_name(0.5)
    assert bases_numbers({}) == 0.0  # files written before the share existed
    assert bases_numbers({"numbers": "0.5"}) == 0.5
    assert 0 <= LOWRANK_NUMBERS <= 1
