"""The lab's rules are one table (posttrainllm/rules.py): results cite them by id, every view and docs/rules.md
read the text there, and no rule's prose is defined anywhere else in the package."""

import ast
import copy

import pytest

from posttrainllm import rules
from posttrainllm.config import PROJECT_ROOT
from posttrainllm.track import derived, explain, report_page
from test_report import _receipt

# Rules still written out where they are applied, to move into the table; this set only shrinks
PROSE_PENDING: dict[str, set[str]] = {}
# Keys named like a rule whose prose is no rule of the lab's: an op's own words for its launch geometry, a view's
# label of the parity rule a path failed
NOT_RULES = {"ops/decode_attention/kernels.py": {"split_rule"}, "track/derived.py": {"rule"}}


def test_docs_rules_md_is_the_table_rendered():
    """docs/rules.md is written by `python -m posttrainllm.rules`: an edit by hand, or a rule changed in the table
    only, fails here."""
    assert (PROJECT_ROOT / rules.DOCS).read_text() == rules.markdown()
    for rid in rules.RULES:
        assert f"## `{rid}`" in rules.markdown()


def test_each_rule_has_a_stable_id_and_names_exactly_its_parameters():
    for rid, rule in rules.RULES.items():
        assert rules.ID.fullmatch(rid), rid
        assert rules.placeholders(rule.text) == set(rule.params), rid
        assert rule.text and rule.where


def _prose_rules() -> dict[str, set[str]]:
    """Module-level names RULE or *_RULE bound to a string (or a sum of strings) in the package, per file."""
    found: dict[str, set[str]] = {}
    package = PROJECT_ROOT / "posttrainllm"
    for path in package.rglob("*.py"):
        for node in ast.parse(path.read_text()).body:
            if not isinstance(node, ast.Assign):
                continue
            names = {t.id for t in node.targets
                     if isinstance(t, ast.Name) and (t.id == "RULE" or t.id.endswith("_RULE"))}
            text = [n for n in ast.walk(node.value) if isinstance(n, (ast.Constant, ast.JoinedStr))
                    and (not isinstance(n, ast.Constant) or isinstance(n.value, str))]
            if names and text and not isinstance(node.value, ast.Call):
                found.setdefault(path.relative_to(package).as_posix(), set()).update(names)
    return found


def _is_rule_key(name: object) -> bool:
    return isinstance(name, str) and (name == "rule" or name.endswith("_rule"))


def _inline_prose_rules() -> dict[str, set[str]]:
    """Keys `rule` or `*_rule` given prose (a string with a space, an f-string) in the package: in a dict literal,
    as `result["rule"] = ...` or as a keyword argument, per file."""
    found: dict[str, set[str]] = {}
    package = PROJECT_ROOT / "posttrainllm"
    for path in package.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            pairs: list[tuple[str, ast.AST]] = []
            if isinstance(node, ast.Dict):
                pairs = [(k.value, v) for k, v in zip(node.keys, node.values)
                         if isinstance(k, ast.Constant) and _is_rule_key(k.value)]
            elif isinstance(node, ast.Assign):
                pairs = [(t.slice.value, node.value) for t in node.targets if isinstance(t, ast.Subscript)
                         and isinstance(t.slice, ast.Constant) and _is_rule_key(t.slice.value)]
            elif isinstance(node, ast.Call):
                pairs = [(kw.arg, kw.value) for kw in node.keywords if _is_rule_key(kw.arg)]
            for key, value in pairs:
                if not isinstance(value, ast.Call) and any(
                        isinstance(n, ast.JoinedStr) or (isinstance(n, ast.Constant) and isinstance(n.value, str)
                                                         and " " in n.value) for n in ast.walk(value)):
                    found.setdefault(path.relative_to(package).as_posix(), set()).add(key)
    return found


def test_no_result_stores_a_rule_written_out_inline():
    """A result's `rule` / `*_rule` is a citation (rules.cite), never prose written where the result is built."""
    assert _inline_prose_rules() == NOT_RULES


def test_no_rule_is_written_out_outside_the_table():
    found = _prose_rules()
    assert {path: names - PROSE_PENDING.get(path, set()) for path, names in found.items()
            if names - PROSE_PENDING.get(path, set())} == {}
    stale = {path: names - found.get(path, set()) for path, names in PROSE_PENDING.items()
             if names - found.get(path, set())}
    assert stale == {}, "a pending prose rule is gone: drop it from PROSE_PENDING"


def test_a_citation_is_the_id_with_its_parameters_and_reads_as_the_tables_text():
    assert rules.cite("band") == "band"
    cited = rules.cite("impossible", fraction=0.5)
    assert cited == {"id": "impossible", "fraction": 0.5}
    assert rules.text(cited).startswith("a median under 0.5 x the roofline's minimum time")
    assert rules.text("band") == rules.RULES["band"].text
    with pytest.raises(KeyError):
        rules.cite("no_such_rule")
    with pytest.raises(TypeError, match="takes \\['fraction'\\]"):
        rules.cite("impossible")
    with pytest.raises(TypeError):
        rules.cite("band", fraction=0.5)


def test_a_rule_with_parts_reads_as_its_text_then_theirs_and_is_cited_with_all_their_parameters():
    """outside_timing includes the outside timing's other rules: one citation, every value its parts' texts hold."""
    for rid, rule in rules.RULES.items():
        assert all(part in rules.RULES and part != rid for part in rule.parts), rid
    whole = rules.full_text("outside_timing")
    for part in rules.RULES["outside_timing"].parts + rules.RULES["outside_agreement"].parts:
        assert rules.RULES[part].text in whole
    assert rules.parameters("outside_timing") >= {"batch_min", "warmups", "other_threads_share", "unreadable_max"}
    with pytest.raises(TypeError, match="takes \\['batch_min'"):
        rules.cite("outside_timing", batch_min=4)
    from posttrainllm.lab.isolation import outside

    said = rules.text(outside.timing_rule())
    assert said.startswith("a user path is timed from outside its worker: batches of N >= 4 distinct")
    assert "the warm-up is 2 batches of 4 sets" in said and "ran over 2% of the span" in said
    assert f"over {outside.UNREADABLE_MAX} unreadable batches" in said and "{" not in said
    assert "Includes, after its own text: [`outside_warmup`](#outside_warmup)" in rules.markdown()


def test_a_message_names_a_rule_by_an_id_the_table_holds():
    assert rules.named("outside_unreadable") == "rule outside_unreadable"
    with pytest.raises(KeyError):
        rules.named("UNREADABLE_RULE")


def test_an_unknown_id_reads_as_unknown_and_old_prose_reads_as_it_is():
    assert rules.text("made_up_rule").startswith("unknown rule 'made_up_rule'")
    assert rules.text({"id": "made_up_rule", "n": 3}).startswith("unknown rule 'made_up_rule'")
    assert "\n" not in rules.text("made_up_rule")
    assert rules.text({"id": "impossible"}).startswith("rule 'impossible' stored without its fraction: ")
    prose = "faster: p80 < other's p20 (a receipt written before rules had ids)"
    assert rules.text(prose) == prose and rules.text(None) == "-"
    assert rules.text({"id": "outside_run_queue", "other_threads_share": "two"}).startswith(
        "rule 'outside_run_queue' stored with {'other_threads_share': 'two'}, which its text cannot show: a span")


def _cited_receipt() -> dict:
    receipt = copy.deepcopy(_receipt("baseline"))
    receipt["parity"].update(rule=rules.cite("parity_contract"), backward_rule="made_up_rule")
    receipt["microbench"].update(bytes=1024, bytes_formula="3 x 4 B", flops=10, flops_formula="2MNK",
                                 band_rule=rules.cite("band"), cost_model_rule=rules.cite("cost_model"),
                                 impossible_rule=rules.cite("impossible", fraction=0.25))
    receipt["microbench"]["curve"]["regime_rule"] = rules.cite("regime", overhead_fraction=0.5, slope_tolerance=0.25)
    receipt["kernel"]["paths"]["triton"]["geometry"] = {"split_rule": "given"}  # the op's own words, not a rule
    receipt["integrity"] = {"rule": rules.cite("integrity"), "problems": []}
    return receipt


def test_explain_and_report_html_read_each_cited_rule_from_the_table():
    """A receipt names its rules by id; explain and the page print the text, an unknown id as unknown."""
    receipt = _cited_receipt()
    said = explain.explain(receipt)
    assert f"rule: {rules.RULES['parity_contract'].text}" in said
    assert "regime rule: per segment between two measured sizes" in said and "under 0.5 x the smaller" in said
    assert f"cost models: {rules.RULES['cost_model'].text}" in said
    cited = dict(derived.cited_rules(receipt))
    assert set(cited) == {"parity_contract", "made_up_rule", "band", "cost_model", "impossible", "regime",
                          "integrity"}
    assert cited["made_up_rule"].startswith("unknown rule 'made_up_rule'")
    assert cited["impossible"].startswith("a median under 0.25 x")
    page = report_page.sweep_page({"baseline": receipt}, PROJECT_ROOT / "runs")
    assert "Rules (7, by id)" in page and "<code>band</code>: faster: p80 &lt; other&#x27;s p20" in page
    assert "<code>made_up_rule</code>: unknown rule" in page and "<code>given</code>" not in page


def test_explain_on_a_copied_receipt_naming_an_unknown_rule_says_so_and_reads_the_rest(tmp_path, capsys):
    """A receipt from another version may name a rule this table lacks: `posttrainllm explain` prints "unknown rule
    '<id>'" in its place (one line) and answers the rest from the receipt; exit 0."""
    import json

    from posttrainllm import cli

    receipt = _cited_receipt()
    receipt["parity"]["rule"] = "renamed_rule"
    (tmp_path / "receipt.json").write_text(json.dumps(receipt))
    assert cli.main(["explain", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    line = next(line for line in out.splitlines() if line.strip().startswith("rule:"))
    assert line.strip().startswith("rule: unknown rule 'renamed_rule'")
    assert "regime rule: per segment between two measured sizes" in out and "2. Memory traffic per path" in out


def test_a_user_paths_timing_and_the_draft_heads_read_their_cited_rules_from_the_table():
    """A user path's timing from outside its worker cites outside_timing (its parts' text in it, the code's
    constants filled in) and timing_seed; the draft heads' receipts cite theirs; report.html lists each once."""
    from posttrainllm.lab.isolation import outside

    receipt = _cited_receipt()
    mode = {"rule": outside.timing_rule(), "timing_seeds": {"base": 11, "rule": rules.cite("timing_seed")}}
    receipt["microbench"]["paths"]["baseline"] = {"valid": False, "reason": "no speed",
                                                  "outside": {"forward": mode, "forward_backward": mode},
                                                  "memory": {"method_rule": rules.cite("outside_memory")}}
    cited = dict(derived.cited_rules(receipt))
    assert cited["outside_timing"] == rules.text(outside.timing_rule())
    assert rules.RULES["outside_null"].text in cited["outside_timing"]
    assert cited["timing_seed"].startswith("the timing's input sets are drawn from a base seed")
    assert cited["outside_memory"].startswith("a user path's peak memory is one forward call's in its worker")
    heads = {"heads/k2": {"verdict": "pass", "base": {"heldout_loss_rule": rules.cite("heldout_loss", eval_batches=2)},
                          "heads": {"accuracy_rule": rules.cite("head_accuracy")},
                          "decode": {"variants": {}, "speedup": {"rule": rules.cite("decode_speedup")}}},
             "heads/k3": {"verdict": "pass", "base": {"heldout_loss_rule": rules.cite("heldout_loss", eval_batches=2)},
                          "decode": {"variants": {}, "mismatches": {"rule": "an older receipt's prose rule"}}}}
    page = report_page.sweep_page({"baseline": receipt}, PROJECT_ROOT / "runs", heads=heads)
    assert "Rules (10, by id)" in page  # the point's 7, outside_timing, timing_seed, outside_memory
    drafts = page[page.index('<section id="draft-heads">'):]
    assert "Rules (3, by id)" in drafts and drafts.count("<code>heldout_loss</code>") == 1
    assert "<code>heldout_loss</code>: mean cross-entropy (nats/byte) over 2 batches" in drafts
