"""The refusals of a policy declared wrongly, one clear H2OStreamError each: a policy class whose declaration makes
no sense is refused when it is defined (`EvictionPolicy.__init_subclass__`, validation.py), one that cannot be named
or whose names clash when it is registered (registry.py), and a part, setting or scores declaration that makes no
sense when it is made (declarations.py). A policy's settings are its dataclass fields (`setting`), its `options`
made from them. Only `register` adds to the registry; the bad classes here are refused before it would, and no test
leaves anything in it (tests/support/policy_matrix.py iterates over every registered policy)."""

from __future__ import annotations

import dataclasses
import re

import pytest

from h2o_stream import H2OStreamError, make_policy, register
from h2o_stream.engine.policies import POLICIES, EvictionPolicy, Part
from h2o_stream.engine.policies.base import HEAVY, RECENT, SINKS, Scores, Setting, setting, shrink_parts
from h2o_stream.engine.policies.h2o import H2OPolicy
from h2o_stream.engine.policies.ranking import AGE, HEAD_CLASS, SCORE

#: the settings a policy that merges declares (validation.MERGE_SETTINGS): name -> (default, help)
MERGE = {"merge_span": (4, "entries a merge spreads over"), "merge_seed": (0, "the coin's seed")}
#: the settings a policy with Gumbel-regularised scores declares (validation.GUMBEL_SETTINGS)
GUMBEL = {
    "tau_init": (1.0, "first temperature"),
    "tau_end": (2.0, "last temperature"),
    "tau_steps": (10, "queries the temperature rises over"),
    "gumbel_seed": (0, "the draws' seed"),
}


def declaring(settings: dict, **attributes) -> dict:
    """A policy class body (for `type`) with `attributes` and each of `settings` (name -> (default, help)) declared
    as its field, as `alpha: float = setting(0.5, "...")` in a class statement declares it."""
    fields = {name: setting(default, help) for name, (default, help) in settings.items()}
    annotations = {name: type(default).__name__ for name, (default, _) in settings.items()}
    return {"__annotations__": annotations, **fields, **attributes}


@pytest.fixture(autouse=True)
def _registry_unchanged():
    """Every policy registered before a test is registered after it, as the same class, and nothing more."""
    before = dict(POLICIES)
    yield
    assert before == POLICIES


# -- refused when the class is defined (validation.check_declaration) ---------------------------------------------


@pytest.mark.parametrize(
    "hand_written",
    [(Setting("alpha", "a", 0.5),), (Setting("beta", "b", 20),), [Setting("alpha", "a", 0.5)], ("alpha",), ()],
    ids=["the-fields-again", "beside-the-fields", "a-list", "a-name", "none"],
)
def test_options_written_by_hand_are_refused(hand_written):
    """A policy's `options` are made from its fields: one written beside them would be a second declaration of each
    setting (or of a setting no field holds), so any is refused, even one that says what the fields say."""
    message = "HandWritten.options are made from its fields: declare each setting as one, with setting(...)"
    with pytest.raises(H2OStreamError, match=rf"\b{re.escape(message)}$"):

        class HandWritten(EvictionPolicy):
            name = "hand-written"
            parts = (RECENT,)
            alpha: float = setting(0.5, "a")
            options = hand_written


def test_options_are_made_from_the_fields_declared_with_setting():
    """Each field made by `setting` is one Setting, its name and default the field's; a plain field is none."""

    @dataclasses.dataclass
    class Declared(EvictionPolicy):
        recent: int
        alpha: float = setting(0.5, "forgetting factor", within=(0, 1), called="the factor")
        note: str = ""  # a field that is no setting (as head_hybrid's calibrated_for)
        flag: bool = setting(False, "a flag", example=True)
        name = "declared"
        parts = (RECENT,)

    assert Declared.options == (
        Setting("alpha", "forgetting factor", 0.5, within=(0, 1), called="the factor"),
        Setting("flag", "a flag", False, example=True),
    )
    assert Declared(recent=4).alpha == 0.5 and Declared(recent=4, alpha=1).alpha == 1.0  # checked: a float
    with pytest.raises(H2OStreamError, match=r"^alpha \(the factor\) must be a number in \(0, 1\], got 2$"):
        Declared(recent=4, alpha=2)


@pytest.mark.parametrize("help", ["", "  ", None], ids=["empty", "blank", "none"])
def test_a_setting_without_its_help_is_refused_when_its_class_is_defined(help):
    message = "the policy setting 'alpha' needs a help text, its command-line option's"
    with pytest.raises(H2OStreamError, match=f"^{message}$"):

        class Unhelpful(EvictionPolicy):
            name = "unhelpful"
            parts = (RECENT,)
            alpha: float = setting(0.5, help)

    with pytest.raises(TypeError, match="help"):
        setting(0.5)  # type: ignore[call-arg]


def test_a_subclass_adds_settings_after_its_bases_and_redeclares_one_in_its_place():
    """The options follow the dataclass fields' order: a base's first, a redeclared one where the base had it."""

    @dataclasses.dataclass
    class Base(EvictionPolicy):
        recent: int
        alpha: float = setting(0.5, "a")
        kernel: int = setting(5, "k", odd=True)
        name = "base"
        parts = (RECENT,)

    @dataclasses.dataclass
    class Derived(Base):
        beta: int = setting(20, "b")
        alpha: float = setting(0.25, "a, smaller")
        name = "derived"

    fields = [field.name for field in dataclasses.fields(Derived) if field.name != "recent"]
    assert [option.name for option in Derived.options] == fields == ["alpha", "kernel", "beta"]
    assert [option.default for option in Derived.options] == [0.25, 5, 20] and Base.options[0].default == 0.5
    assert vars(Derived(recent=4)) == {"recent": 4, "alpha": 0.25, "kernel": 5, "beta": 20}


def test_a_bases_setting_redeclared_as_a_plain_field_is_refused():
    """A plain default would leave the base's Setting (its default, its bounds) beside the new field."""

    @dataclasses.dataclass
    class Base(EvictionPolicy):
        recent: int
        alpha: float = setting(0.5, "a")
        name = "base"
        parts = (RECENT,)

    message = "Plain.alpha redeclares a setting: declare it with setting(...)"
    with pytest.raises(H2OStreamError, match=rf"\b{re.escape(message)}$"):

        class Plain(Base):
            alpha: float = 0.25


@pytest.mark.parametrize(
    "declaration",
    [
        # a schedule that is not one
        dict(parts=(HEAVY, RECENT), scoring=Scores(), ranking=SCORE, layer_schedule="staircase"),
        # ranked by age: nothing ranked to spread over the layers
        dict(parts=(HEAVY, RECENT), ranking=AGE, layer_schedule="pyramid"),
        # no ranked part at all
        dict(parts=(SINKS, RECENT), scoring=Scores(), ranking=SCORE, layer_schedule="pyramid"),
        # two ranked parts: which one the schedule spreads is not said
        dict(
            parts=(HEAVY, Part("light", "l", fixed=2), RECENT),
            scoring=Scores(),
            ranking=SCORE,
            layer_schedule="pyramid",
        ),
    ],
    ids=["unknown", "by-age", "no-ranked-part", "two-ranked-parts"],
)
def test_a_layer_schedule_without_one_ranked_part_to_spread_is_refused(declaration):
    message = "Scheduled.layer_schedule must be one of pyramid, for a policy with a ranking and one ranked part"
    with pytest.raises(H2OStreamError, match=f"^{re.escape(message)}$"):
        type("Scheduled", (EvictionPolicy,), declaring({"beta": (20, "b")}, name="scheduled", **declaration))


def test_a_ranking_of_its_own_takes_no_layer_schedule():
    """ranking None (a `keep` of its own) has nothing the engine could spread."""
    with pytest.raises(H2OStreamError, match=r"\bOwnCut\.layer_schedule must be one of pyramid, for a policy with"):

        class OwnCut(EvictionPolicy):
            name = "own-cut"
            parts = (HEAVY, RECENT)
            beta: int = setting(20, "b")
            layer_schedule = "pyramid"

            def keep(self, positions, scores):
                return positions


@pytest.mark.parametrize("missing", list(GUMBEL))
def test_gumbel_scores_without_every_temperature_setting_are_refused(missing):
    settings = {name: declared for name, declared in GUMBEL.items() if name != missing}
    with pytest.raises(
        H2OStreamError,
        match=re.escape(
            "Noisy has Gumbel-regularised scores and needs the settings tau_init, tau_end, tau_steps, gumbel_seed"
        ),
    ):
        type(
            "Noisy",
            (EvictionPolicy,),
            declaring(settings, name="noisy", parts=(HEAVY, RECENT), scoring=Scores(gumbel=True), ranking=SCORE),
        )


@pytest.mark.parametrize("bad_eviction", ["evict", "Drop", None])
def test_an_eviction_other_than_drop_or_merge_is_refused(bad_eviction):
    with pytest.raises(H2OStreamError, match=r"\bEvicting\.eviction must be one of drop, merge$"):

        class Evicting(EvictionPolicy):
            name = "evicting"
            parts = (RECENT,)
            eviction = bad_eviction


@pytest.mark.parametrize(
    "its_scoring, its_ranking, its_settings",
    [
        (None, AGE, MERGE),  # nothing to merge by
        (Scores(), SCORE, MERGE),  # summed, not the latest attention
        (Scores("latest", heads="layer"), SCORE, MERGE),  # one decision per layer, not per KV head
        (Scores("latest"), SCORE, {"merge_span": MERGE["merge_span"]}),  # no merge_seed
        (Scores("latest"), SCORE, {"merge_seed": MERGE["merge_seed"]}),  # no merge_span
    ],
    ids=["no-scores", "summed", "per-layer", "no-seed", "no-span"],
)
def test_merging_without_the_latest_per_kv_head_scores_and_its_settings_is_refused(
    its_scoring, its_ranking, its_settings
):
    message = (
        "Merging merges what it evicts and needs Scores('latest') per KV head and the settings merge_span, merge_seed"
    )
    declaration = dict(name="merging", parts=(HEAVY, RECENT), eviction="merge", scoring=its_scoring)
    with pytest.raises(H2OStreamError, match=rf"\b{re.escape(message)}$"):
        type("Merging", (EvictionPolicy,), declaring(its_settings, ranking=its_ranking, **declaration))


def test_a_merging_declaration_with_all_it_needs_is_taken():
    """The refusals above are about what is missing: the same class with all of it is a policy (not registered)."""

    class Merging(EvictionPolicy):
        name = "merging"
        parts = (HEAVY, RECENT)
        eviction = "merge"
        scoring = Scores("latest")
        ranking = SCORE
        merge_span: int = setting(4, "entries a merge spreads over")
        merge_seed: int = setting(0, "the coin's seed")

    assert Merging.needs_scores and Merging.score_queries == "last" and "merging" not in POLICIES


# -- refused when the class is registered (registry.register) -------------------------------------------------------


@pytest.mark.parametrize("name", [None, "", 7], ids=["none", "empty", "a-number"])
def test_a_policy_without_a_name_is_not_registered(name):
    attributes = {"parts": (RECENT,)} if name is None else {"name": name, "parts": (RECENT,)}
    nameless = type("Nameless", (EvictionPolicy,), attributes)  # a declaration that makes sense: defined
    with pytest.raises(H2OStreamError, match=r"^Nameless needs a class attribute `name` to be registered$"):
        register(nameless)
    assert nameless not in POLICIES.values()


def test_a_policy_with_a_setting_named_as_a_part_is_not_registered():
    """(Two settings of one name cannot be declared: a class has one field of a name, and a subclass redeclaring a
    base's setting replaces it, test_a_subclass_adds_settings_after_its_bases_and_redeclares_one_in_its_place.)"""
    declared = declaring({"recent": (1.0, "a setting called as a part")}, name="clashing", parts=(HEAVY, RECENT))
    clashing = type("Clashing", (EvictionPolicy,), declared)
    with pytest.raises(H2OStreamError, match=r"^Clashing's settings need names none of its parts has$"):
        register(dataclasses.dataclass(clashing))
    assert "clashing" not in POLICIES


def test_a_policy_whose_settings_are_no_constructor_arguments_is_not_registered():
    """Without @dataclass (below @register) the fields declared with `setting` are no constructor arguments, and the
    options' defaults would reach no policy."""

    class Undated(EvictionPolicy):
        name = "undated"
        parts = (RECENT,)
        alpha: float = setting(0.5, "a")

    @dataclasses.dataclass
    class Dated(EvictionPolicy):
        recent: int
        name = "dated"
        parts = (RECENT,)

    class DatedBelow(Dated):  # its base is a dataclass, its own setting is no field of it
        alpha: float = setting(0.5, "a")

    for undated in (Undated, DatedBelow):
        with pytest.raises(H2OStreamError, match=rf"^{undated.__qualname__} needs @dataclass below @register: its"):
            register(undated)
    assert "undated" not in POLICIES and "dated" not in POLICIES


# -- refused when the declaration is made (declarations.py) ---------------------------------------------------------


def test_a_part_with_both_a_fixed_and_a_shared_default_is_refused():
    with pytest.raises(H2OStreamError, match=r"^part 'heavy' has both a fixed and a shared default; give one$"):
        Part("heavy", "h", fixed=4, share=0.5)


def test_only_the_rest_part_has_no_default_of_its_own():
    """A rest part's default is decided by the others (`split_budget`): none of its own, in words the remainder."""
    assert RECENT.is_rest and RECENT.default(16) is None
    assert RECENT.default_text == "the cache size minus the other parts"
    assert (HEAVY.default(15), SINKS.default(15)) == (7, 4)


@pytest.mark.parametrize("name", ["two words", "", "1st", "beta-2"])
def test_a_setting_needs_a_name_usable_as_an_argument(name):
    with pytest.raises(
        H2OStreamError, match=f"^a policy setting needs a name usable as an argument, got {re.escape(repr(name))}$"
    ):
        Setting(name, "x", 1.0)


@pytest.mark.parametrize("window", [0, ""], ids=["zero", "no-setting"])
def test_window_scores_need_the_windows_length(window):
    with pytest.raises(H2OStreamError, match=r"^window scores need the window's length \(a number or a setting's"):
        Scores("window", window=window)
    assert Scores("window", window=8).window == 8 and Scores("window", window="observed").window == "observed"


@pytest.mark.parametrize("heavy", [2.5, "3", True, None], ids=["float", "text", "bool", "none"])
def test_a_part_that_is_not_an_integer_is_refused(heavy):
    with pytest.raises(H2OStreamError, match=f"^heavy must be an integer, got {re.escape(repr(heavy))}$"):
        H2OPolicy(heavy=heavy, recent=8)


def test_make_policy_refuses_a_part_that_is_not_an_integer():
    with pytest.raises(H2OStreamError, match=r"^heavy must be an integer, got 2\.5$"):
        make_policy("h2o", 16, heavy=2.5)
    with pytest.raises(H2OStreamError, match=r"^cache size must be an integer, got '16'$"):
        make_policy("h2o", "16")


def test_shrinking_every_part_to_nothing_without_sinks_leaves_them_all_empty():
    """`shrink_parts` with a cut of everything there is, for parts without sinks: each part empty. (Unreached by
    `EvictionPolicy.reduced`, which keeps a budget >= 1: with no sinks the cut is always less than the parts.)"""
    assert shrink_parts({"heavy": 3, "recent": 5}, 8) == {"heavy": 0, "recent": 0}
    # with sinks, they give up what the others could not
    assert shrink_parts({"sinks": 4, "recent": 5}, 7) == {"sinks": 2, "recent": 0}


@pytest.mark.parametrize(
    "declared",
    [dict(accumulate="sum", quantile=0.9), dict(accumulate="window", window=4, quantile=0.9, gumbel=True)],
    ids=["not-window", "gumbel"],
)
def test_counts_above_a_quantile_are_window_scores_of_the_models_attention(declared):
    with pytest.raises(H2OStreamError, match="^counts above a quantile are window scores of the model's own attention"):
        Scores(**declared)
    assert Scores("window", window=4, quantile="q").quantile == "q"


def test_a_required_setting_needs_an_example_and_is_refused_when_missing():
    with pytest.raises(H2OStreamError, match="^the required setting 'classes' needs an example value$"):
        Setting("classes", "which heads", "", required=True)
    classes = Setting("classes", "which heads", "", required=True, example="*.0", called="a list of heads")
    with pytest.raises(H2OStreamError, match="^classes must be given: a list of heads$"):
        classes.check("")
    with pytest.raises(H2OStreamError, match="^classes must be text, got 3$"):
        classes.check(3)
    assert classes.check("0.1") == "0.1"


def test_ranking_by_head_class_needs_scores_and_the_classes_setting():
    with pytest.raises(H2OStreamError, match="ranks by head_class and needs a scoring"):

        class Unscored(EvictionPolicy):
            name = "unscored"
            parts = (HEAVY, RECENT)
            ranking = HEAD_CLASS

    with pytest.raises(H2OStreamError, match="ranks by head_class and needs the settings retrieval_heads"):

        class Unclassed(EvictionPolicy):
            name = "unclassed"
            parts = (HEAVY, RECENT)
            scoring = Scores("sum")
            ranking = HEAD_CLASS
