"""The helpers in common/ and their generated copies inside the kernel packages."""

from tools import vendor


def test_vendored_copies_match_their_source():
    assert vendor.stale() == [], "run `python -m tools.vendor`"


def test_every_copy_is_marked_generated():
    for path, text in vendor.copies().items():
        assert text.startswith("# Generated from common/"), path
