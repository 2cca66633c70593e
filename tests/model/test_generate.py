"""The stop matcher streams the text up to a stop string, never a whole stop string, and all of
it when none comes, however the text is cut into pieces."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from model.generate import StopMatcher

pieces = st.lists(st.text(alphabet="ab\n", max_size=4), max_size=12)
stops = st.lists(st.text(alphabet="ab\n", min_size=1, max_size=3), max_size=3)


def stream(matcher: StopMatcher, texts: list[str]) -> tuple[str, bool]:
    """Everything the matcher emits for ``texts`` (then flushed, if no stop came), and whether
    a stop string ended it."""
    emitted = ""
    for text in texts:
        out, stopped = matcher.push(text)
        emitted += out
        if stopped:
            return emitted, True
    return emitted + matcher.flush(), False


@given(pieces, stops)
def test_it_emits_the_text_up_to_a_stop_string(texts: list[str], stop: list[str]) -> None:
    """Where stop strings overlap in one piece, the one starting first wins (so the cut may
    depend on the pieces); wherever it cuts, a stop string starts there and none lies before."""
    whole = "".join(texts)
    emitted, stopped = stream(StopMatcher(stop), texts)
    assert whole.startswith(emitted)
    assert not any(s in emitted for s in stop)
    if stopped:
        assert any(whole[len(emitted) :].startswith(s) for s in stop)
    else:
        assert emitted == whole and not any(s in whole for s in stop)


@given(pieces)
def test_without_stop_strings_each_piece_comes_out_as_it_goes_in(texts: list[str]) -> None:
    matcher = StopMatcher([])
    assert [matcher.push(text) for text in texts] == [(text, False) for text in texts]
    assert matcher.flush() == ""
