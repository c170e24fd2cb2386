"""The generated parts of the kernel cards are current."""

from tools import cards
from tools.common import all_kernels


def test_cards_show_their_current_table_of_fast_paths():
    for kernel in all_kernels():
        assert cards.rendered(kernel) == (kernel.path / "README.md").read_text(), (
            f"{kernel.name}: run `python -m tools.cards`")


def test_packages_with_gluon_kernels_have_a_table():
    for kernel in all_kernels():
        if (kernel.source / "gluon").is_dir():
            assert cards.fast_paths_table(kernel) is not None, kernel.name
