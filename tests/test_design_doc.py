"""The design doc is the one the code cites: ``docs/design.md``.

* every ``docs/design.md §N[.M]`` reference in the tracked files names a numbered heading of the doc;
* every numbered heading carries its stable anchor (``<a id="sN-M"></a>``), and every
  ``docs/design.md#…`` link names an anchor that exists;
* the sections the code cites keep their numbers and subjects (§1 Terms … §5 megatron-core without
  a GPU), and each still states the facts citing lines rely on;
* every name in the §3 tables imports, and every signature given there matches the code's
  (new optional parameters may be missing from the doc; nothing else may differ).

Reads files and imports modules only (no collectives); the runtime and Megatron rows are skipped
only when torch / megatron-core is not installed.
"""

from __future__ import annotations

import enum
import importlib
import importlib.util
import inspect
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "design.md"
DOC_PATH = "docs/design" + ".md"  # spelled apart so this file's own text never looks like a reference

# "<doc> §2.1", "<doc> §1, §2.3", "<doc> §1–2" (a range of top-level sections), "<doc> §4's".
_REF = re.compile(re.escape(DOC_PATH) + r"\s*§(\d+(?:\.\d+)*)((?:\s*,\s*§\d+(?:\.\d+)*|\s*[–-]\s*\d+(?:\.\d+)*)*)")
_MORE = re.compile(r"(,\s*§|[–-]\s*)(\d+(?:\.\d+)*)")
_LINK = re.compile(re.escape(DOC_PATH) + r"#([\w-]+)")
_HEADING = re.compile(r"^(#{2,4})\s+(\d+(?:\.\d+)*)\.?\s+(.+?)\s*$")
_ANCHOR = re.compile(r'^<a id="([\w-]+)"></a>\s*$')

# Section -> (words its title must contain, facts its text must state). The facts are what the
# citing lines assume (e.g. launch/config.py: "K = 2**10, M = 2**20, as in §1"); a section that
# loses one of them no longer says what the code says it does.
EXPECTED = {
    "1": ("terms", ("i·P_intra + j", "2¹⁰", "2²⁰", "per tensor-parallel rank", "intra×inter", "local_token_indices")),
    "2": ("layers", ("never torch", "megatron-core")),
    "2.1": ("plan", ("Work units", "Placement", "Stages", "Code generation", "Verifier", "Cost model",
                     "max(4 × L × (H/P_intra) × (d_qk + d_v) × dtype_bytes, 1 MiB)", "exact",
                     "counts of attention blocks", "Plan.hash")),
    "2.2": ("runtime", ("fp32", "merge", "batch_isend_irecv", "HSAP_P2P_TIMEOUT_S", "SAPAttention", "HSAPAttention")),
    "2.3": ("megatron", ("initialize_hsap", "HSAP_LAYER_SPEC", "position inside its document", "get_batch_on_this_cp_rank",
                         "--calculate-per-token-loss")),
    "2.4": ("bench", ("flat", "simulator", "plan/hardware.py")),
    "3": ("public api", ("compile_plan", "hsap_attn_func", "HSAPError")),
    "4": ("measures", ("2.5×", "max(bytes sent, bytes received)", "necessary traffic", "190 / 170", "230 GB/s",
                       "23 GB/s", "Link class", "10 seeded batches", "median and the worst",
                       "source, workload, T, P_intra, P_inter, link, heads, seed, method, metric, value, unit",
                       "16K", "1.6K", "never does worse than leaving every block with its q owner", "compute bound",
                       "Baselines priced on the same batch")),
    "5": ("without a gpu", ("cpu_shims", "pretrain()", "reduce_scatter_tensor", "all_gather_into_tensor", "AVG",
                            "disable_jit_fuser", "GPTModelConfig", "vp_stage", "before Megatron parses its arguments")),
}


def _tracked_files() -> list[Path]:
    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        pytest.skip("not a git checkout (git ls-files failed): cannot list the tracked files")
    return [ROOT / name for name in out.decode().split("\0") if name]


def _text(path: Path) -> str | None:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return None  # binary (docs/layouts.png) or deleted in the working tree


def _doc() -> str:
    assert DOC.is_file(), f"{DOC_PATH} is missing: the code cites it"
    return DOC.read_text(encoding="utf-8")


def _sections(doc: str) -> dict[str, tuple[str, str | None, str]]:
    """{number: (title, anchor id on the line before, body)}; a body runs to the next heading that is
    not one of the section's own subsections (§2's body covers §2.1–§2.4)."""
    lines = doc.splitlines()
    heads = []
    for n, line in enumerate(lines):
        m = _HEADING.match(line)
        if m:
            prev = next((lines[k] for k in range(n - 1, -1, -1) if lines[k].strip()), "")
            anchor = _ANCHOR.match(prev)
            heads.append((n, m.group(2), m.group(3), anchor.group(1) if anchor else None))
    out = {}
    for idx, (n, number, title, anchor) in enumerate(heads):
        end = next((later[0] for later in heads[idx + 1:] if not later[1].startswith(number + ".")), len(lines))
        out[number] = (title, anchor, "\n".join(lines[n + 1 : end]))
    return out


def _references(text: str) -> list[tuple[int, str]]:
    """(line number, section) of every design-doc reference in ``text``."""
    refs = []
    for m in _REF.finditer(text):
        line = text.count("\n", 0, m.start()) + 1
        first = m.group(1)
        refs.append((line, first))
        for sep, number in _MORE.findall(m.group(2)):
            if sep.strip().startswith(","):
                refs.append((line, number))
            else:  # a range "§1–2": every further top-level section up to the last
                lo, hi = int(first.split(".")[0]), int(number.split(".")[0])
                refs.extend((line, str(k)) for k in range(lo + 1, hi + 1))
    return refs


def test_reference_parser_reads_every_form() -> None:
    # The parser itself, on the forms the code uses (so a parser bug cannot hide a dangling reference).
    text = f"a {DOC_PATH} §2.1 step 4\nb {DOC_PATH} §1, §2.3.\nc ({DOC_PATH} §1–2)\nd {DOC_PATH} §4's list, 2 seeds"
    assert _references(text) == [(1, "2.1"), (2, "1"), (2, "2.3"), (3, "1"), (3, "2"), (4, "4")]


def test_every_reference_resolves_to_a_heading() -> None:
    sections = _sections(_doc())
    dangling = []
    count = 0
    for path in _tracked_files():
        text = _text(path)
        if text is None or DOC_PATH not in text:
            continue
        for line, number in _references(text):
            count += 1
            if number not in sections:
                dangling.append(f"{path.relative_to(ROOT)}:{line}: §{number}")
    assert count >= 50, f"found only {count} references to {DOC_PATH}; the parser or the file listing is broken"
    assert not dangling, (
        f"references to sections {DOC_PATH} does not have (add the section, or fix the citing line): "
        + ", ".join(dangling)
    )


def test_links_name_existing_anchors() -> None:
    doc = _doc()
    ids = set(re.findall(r'<a id="([\w-]+)"></a>', doc))
    bad = []
    for path in _tracked_files():
        text = _text(path)
        if text is None:
            continue
        for m in _LINK.finditer(text):
            if m.group(1) not in ids:
                bad.append(f"{path.relative_to(ROOT)}: #{m.group(1)}")
    internal = re.findall(r"\]\(#([\w-]+)\)", doc)  # the doc's own [§N](#sN) links
    bad += [f"{DOC_PATH}: (#{a})" for a in internal if a not in ids]
    assert internal, "the doc should link its own sections"
    assert not bad, f"links to anchors {DOC_PATH} does not define: {bad}"


def test_every_numbered_heading_has_its_anchor() -> None:
    sections = _sections(_doc())
    wrong = {n: a for n, (_, a, _) in sections.items() if a != "s" + n.replace(".", "-")}
    assert not wrong, f"numbered headings need `<a id=\"sN-M\"></a>` on the line before them; got {wrong}"
    numbers = sorted(sections, key=lambda n: tuple(map(int, n.split("."))))
    for n in numbers:  # no gaps: 2.1 needs 2, 2.2 needs 2.1
        *parent, last = n.split(".")
        if parent:
            assert ".".join(parent) in sections, f"§{n} has no parent section"
        if int(last) > 1:
            assert ".".join([*parent, str(int(last) - 1)]) in sections, f"§{n} has no predecessor"


@pytest.mark.parametrize("number", sorted(EXPECTED))
def test_cited_sections_keep_their_subject(number: str) -> None:
    sections = _sections(_doc())
    assert number in sections, f"§{number} is cited by the code but missing from {DOC_PATH}"
    title, _, body = sections[number]
    words, facts = EXPECTED[number]
    assert words in title.lower(), f"§{number} is {title!r}; the code cites it as the {words!r} section"
    flat = " ".join(body.split())  # facts may wrap across lines
    missing = [f for f in facts if " ".join(f.split()) not in flat]
    assert not missing, f"§{number} ({title}) no longer states {missing}, which citing lines rely on"


# --------------------------------------------------------------------------- §3: names and signatures


def _plain_signature(obj: object, documented: set[str] | None = None) -> str:
    """``(a, b=1, *, c=None, **options)``: names, kinds and defaults, no annotations, no ``self``.

    With ``documented`` (the names a doc row gives), optional parameters the row leaves out are
    dropped: the row must still name every required parameter and every documented one exactly,
    but code may grow new optional parameters without the doc listing them."""
    params = list(inspect.signature(obj).parameters.values())
    if params and params[0].name in ("self", "cls"):
        params = params[1:]
    if documented is not None:
        params = [p for p in params if p.name in documented
                  or (p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD))]
    out: list[str] = []
    star = False
    for i, p in enumerate(params):
        if p.kind is p.KEYWORD_ONLY and not star:
            out.append("*")
            star = True
        if p.kind is p.VAR_POSITIONAL:
            out.append("*" + p.name)
            star = True
            continue
        if p.kind is p.VAR_KEYWORD:
            out.append("**" + p.name)
            continue
        text = p.name
        if p.default is not p.empty:
            d = p.default
            text += "=" + (f"{type(d).__name__}.{d.name}" if isinstance(d, enum.Enum) else repr(d))
        out.append(text)
        if p.kind is p.POSITIONAL_ONLY and (i + 1 == len(params) or params[i + 1].kind is not p.POSITIONAL_ONLY):
            out.append("/")
    return "(" + ", ".join(out) + ")"


def _documented_names(signature: str) -> set[str]:
    """Parameter names of a ``(a, b=1, *, c=None, **kw)`` string (defaults in the doc hold no commas)."""
    names = set()
    for token in signature.strip("()").split(","):
        name = token.strip().lstrip("*").split("=")[0].strip()
        if name:
            names.add(name)
    return names


def test_plain_signature_format() -> None:
    class Mode(enum.Enum):
        ON = "on"

    def f(a, b=1, /, c="x", *args, d=None, e=Mode.ON, **kw): ...

    class C:
        def m(self, x, *, y=2): ...

    assert _plain_signature(f) == "(a, b=1, /, c='x', *args, d=None, e=Mode.ON, **kw)"
    assert _plain_signature(C.m) == "(x, *, y=2)"
    # optional parameters a doc row leaves out are dropped; required ones never are
    assert _plain_signature(f, {"a", "c"}) == "(a, /, c='x')"
    assert _plain_signature(C.m, set()) == "(x)"
    assert _documented_names("(a, b=1, *, c=None, **kw)") == {"a", "b", "c", "kw"}


def _api_rows() -> list[tuple[str, str | None]]:
    """(dotted name, signature or None) of every row of the §3 tables."""
    body = _sections(_doc())["3"][2]
    rows = []
    for line in body.splitlines():
        m = re.match(r"^\|\s*`(megatron_hsap(?:\.\w+)+)`\s*\|\s*(.*?)\s*\|", line)
        if m:
            sig = m.group(2)
            rows.append((m.group(1), sig.strip("`") if sig.startswith("`") else None))
    return rows


def _needs(name: str) -> str | None:
    if name.startswith("megatron_hsap.megatron"):
        return "megatron.core"
    if name.startswith("megatron_hsap.runtime") or name == "megatron_hsap.hsap_attn_func":
        return "torch"
    return None


def _resolve(name: str) -> object:
    """Import the longest module prefix of ``name``, then getattr the rest."""
    parts = name.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError as exc:
            if exc.name and not ".".join(parts[:cut]).startswith(exc.name):
                raise  # a real missing dependency inside the module, not "this is an attribute"
            continue
        for attr in parts[cut:]:
            obj = getattr(obj, attr)
        return obj
    raise ImportError(name)


def test_api_tables_list_the_contract() -> None:
    names = {n for n, _ in _api_rows()}
    # The names the original shared design promised in its §3 (issue 17 item 1): the tables must keep them.
    required = {
        "megatron_hsap.compile_plan", "megatron_hsap.hsap_attn_func", "megatron_hsap.HSAPError",
        "megatron_hsap.Plan.local_token_indices", "megatron_hsap.Plan.compute_units", "megatron_hsap.Plan.messages",
        "megatron_hsap.Plan.stats", "megatron_hsap.Plan.verify", "megatron_hsap.Plan.dump",
        "megatron_hsap.megatron.initialize_hsap", "megatron_hsap.megatron.hsap_layer_spec",
        "megatron_hsap.megatron.get_batch_on_this_cp_rank",
    }
    assert required <= names, f"§3 no longer lists {sorted(required - names)}"
    assert sum(1 for _, s in _api_rows() if s) >= 10, "§3 should give the signatures of the main entry points"


@pytest.mark.parametrize("name, signature", _api_rows() if DOC.is_file() else [])
def test_api_row_matches_the_code(name: str, signature: str | None) -> None:
    need = _needs(name)  # torch / megatron-core rows are skipped only where those are not installed
    if need is not None and (importlib.util.find_spec(need.split(".")[0]) is None or importlib.util.find_spec(need) is None):
        pytest.skip(f"{need} is not installed")
    obj = _resolve(name)
    if signature is None:
        return
    assert callable(obj), f"{name} is listed with a signature but is not callable"
    got = _plain_signature(obj, _documented_names(signature))
    assert got == signature, (
        f"{DOC_PATH} §3 gives {name}{signature} but the code has {name}{_plain_signature(obj)}; update one of "
        "them (optional parameters may be left out of the doc row; required ones and listed ones must match)"
    )


def test_stats_keys_listed_in_section_3_exist() -> None:
    # §3 lists Plan.stats() keys by name; every one must be a key of a real plan's stats.
    from megatron_hsap.plan import compile_plan

    body = _sections(_doc())["3"][2]
    row = next(line for line in body.splitlines() if line.startswith("| `megatron_hsap.Plan.stats`"))
    listed = re.findall(r"(\w+)(?=,|\s*…)", row.split("|")[3].split("`")[1])
    keys = set(compile_plan([0, 300, 1000, 1024], 2, num_heads=4, head_dim=16, layout="contiguous").stats().as_dict())
    assert len(listed) >= 20, listed
    assert not set(listed) - keys, f"§3 lists stats keys the plan does not have: {sorted(set(listed) - keys)}"


def test_reference_constants_in_section_4_are_the_code_s() -> None:
    # §4's constant table against plan/hardware.py (the planner and the simulator read the code).
    from megatron_hsap.plan.hardware import HARDWARE

    body = _sections(_doc())["4"][2]
    rows = re.findall(r"^\s*\|\s*`([\w-]+)`\s*\|\s*([\d.]+) / ([\d.]+) TFLOP/s[^|]*\|\s*([\d.]+) GB/s[^|]*\|\s*([\d.]+) GB/s"
                      r"[^|]*\|\s*([\d.]+) µs / ([\d.]+) µs", body, flags=re.M)
    assert {"a100", "h100"} <= {r[0] for r in rows}, f"§4 should list the A100 and H100 constants, found {rows}"
    for name, fwd, bwd, nvl, ib, lat_in, lat_out in rows:
        assert name in HARDWARE, f"§4 lists constant set {name!r}, which plan/hardware.py does not define"
        hw = HARDWARE[name]
        doc = tuple(map(float, (fwd, bwd, nvl, ib, lat_in, lat_out)))
        code = (hw.attn_fwd_flops / 1e12, hw.attn_bwd_flops / 1e12, hw.nvlink_bw / 1e9, hw.ib_bw / 1e9,
                hw.nvlink_latency * 1e6, hw.ib_latency * 1e6)
        assert doc == pytest.approx(code), f"§4 gives {name} {doc}, plan/hardware.py has {code} (TFLOP/s, GB/s, µs)"


def test_result_columns_in_section_4_are_the_code_s() -> None:
    from megatron_hsap.sim.results import COLUMNS

    flat = " ".join(_sections(_doc())["4"][2].split())
    assert f"`{', '.join(COLUMNS)}`" in flat, f"§4's CSV columns must read `{', '.join(COLUMNS)}` (sim/results.py COLUMNS)"


def test_plan_attributes_listed_in_section_3_exist() -> None:
    from megatron_hsap.plan import compile_plan

    body = _sections(_doc())["3"][2]
    row = next(line for line in body.splitlines() if line.startswith("| `megatron_hsap.Plan` |"))
    listed = re.findall(r"`(\w+)`", row.split("|")[3])
    plan = compile_plan([0, 300, 1000, 1024], 2, num_heads=4, head_dim=16, layout="contiguous")
    assert len(listed) >= 10, listed
    assert not [a for a in listed if not hasattr(plan, a)], f"§3 lists Plan attributes the code lacks: {[a for a in listed if not hasattr(plan, a)]}"
    assert (plan.num_tokens, plan.padded_tokens, plan.chunk_tokens, plan.local_tokens, plan.cp_size) == (1024, 1024, 512, 512, 2)


def test_no_reference_points_outside_the_repository() -> None:
    # The shared design file the project started from is not in a clone: cite docs/design.md.
    stale = re.compile(r"\bDESIGN(?:\.md)?\s*§\s*\d")
    bad = []
    for path in _tracked_files():
        text = _text(path)
        if text is not None and path.resolve() != Path(__file__).resolve():
            bad += [f"{path.relative_to(ROOT)}:{text.count(chr(10), 0, m.start()) + 1}" for m in stale.finditer(text)]
    assert not bad, f"references to a design file outside the repository (cite {DOC_PATH} §N instead): {bad}"
