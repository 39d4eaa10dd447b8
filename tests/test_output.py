"""Stop strings, think split and streaming text assembly of one choice."""

from __future__ import annotations

from pantheon.chat.output import Delta, StopFilter, ThinkSplitter


def feed_stop(stops: list[str], pieces: list[str]) -> tuple[str, bool]:
    f = StopFilter(stops)
    out = "".join(f.push(p) for p in pieces)
    out += f.flush()
    return out, f.stopped


def test_stop_string_inside_one_piece_is_cut_and_not_returned() -> None:
    assert feed_stop(["END"], ["hello END world"]) == ("hello ", True)


def test_stop_string_split_across_pieces_is_caught() -> None:
    assert feed_stop(["<stop>"], ["abc<", "st", "op>tail"]) == ("abc", True)


def test_partial_stop_prefix_that_never_completes_is_released() -> None:
    out, stopped = feed_stop(["<stop>"], ["abc<st", "uff"])
    assert (out, stopped) == ("abc<stuff", False)


def test_held_back_tail_is_released_at_flush() -> None:
    assert feed_stop(["xyz"], ["abcx"]) == ("abcx", False)


def test_earliest_of_several_stops_wins() -> None:
    assert feed_stop(["bb", "a"], ["xxbba"]) == ("xx", True)


def test_no_stops_passes_everything_through() -> None:
    f = StopFilter([])
    assert f.push("abc") == "abc"
    assert not f.stopped


def split(pieces: list[str], *, enabled: bool = True, in_think: bool = False) -> tuple[str, str]:
    splitter = ThinkSplitter(enabled, in_think)
    d = Delta()
    for p in pieces:
        splitter.push(p, d)
    splitter.flush(d)
    return d.reasoning, d.content


def test_think_block_at_start_goes_to_reasoning() -> None:
    assert split(["<think>", "plan it", "</think>", "\n\nanswer"]) == ("plan it", "answer")


def test_think_tags_split_across_pieces() -> None:
    assert split(["<thi", "nk>ab", "c</th", "ink>done"]) == ("abc", "done")


def test_prompt_opened_think_block() -> None:
    assert split(["reason", "ing</think>text"], in_think=True) == ("reasoning", "text")


def test_think_tag_later_in_output_is_plain_content() -> None:
    assert split(["hello <think>x</think>"]) == ("", "hello <think>x</think>")


def test_disabled_splitter_returns_everything_as_content() -> None:
    assert split(["<think>a</think>b"], enabled=False) == ("", "<think>a</think>b")


def test_unclosed_think_block_is_reasoning() -> None:
    assert split(["<think>never closes"]) == ("never closes", "")
