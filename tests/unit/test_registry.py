"""The generic plug-in registry every family uses (`cje_engine.registry.Registry`)."""
import pytest

from cje_engine.errors import CJEInputError
from cje_engine.registry import Registry


class _Entry:
    def __init__(self, name):
        self.name = name


def _no_x(entry):
    if entry.name.startswith("x"):
        raise TypeError(f"toy {entry.name!r} starts with x")


def test_entries_keep_registration_order_and_replace_only_when_asked():
    reg = Registry("toy", check=_no_x)
    a, b = reg.register(_Entry("alpha")), reg.register(_Entry("beta"))
    assert reg.names() == ("alpha", "beta") and reg.entries() == (a, b) and len(reg) == 2
    with pytest.raises(ValueError, match="toy 'alpha' is already registered"):
        reg.register(_Entry("alpha"))
    a2 = reg.register(_Entry("alpha"), replace=True)
    assert reg.get("alpha") is a2 and reg.names() == ("alpha", "beta")
    reg.unregister("alpha")
    reg.unregister("never")  # removing what is not there is a no-op
    assert reg.names() == ("beta",) and "alpha" not in reg


def test_the_family_check_runs_before_registration():
    reg = Registry("toy", check=_no_x)
    with pytest.raises(TypeError, match="starts with x"):
        reg.register(_Entry("xeno"))
    with pytest.raises(ValueError, match="non-empty string name"):
        Registry("toy").register(_Entry(""))
    assert reg.names() == ()


def test_an_unknown_name_is_an_input_error_naming_the_choices_and_the_closest():
    reg = Registry("importer", option="format")
    reg.register(_Entry("promptfoo"))
    reg.register(_Entry("inspect"))
    with pytest.raises(CJEInputError, match=r"unknown importer 'promptfo'; expected one of \['promptfoo', 'inspect'\]"
                                            r".*did you mean 'promptfoo'") as e:
        reg.get("promptfo")
    assert e.value.option == "format"
    with pytest.raises(CJEInputError, match=r"unknown server importer 'promptfoo'; expected one of \['inspect'\]"):
        reg.get("promptfoo", choices=("inspect",), what="server importer")
