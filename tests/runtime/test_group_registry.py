"""The one group registry (runtime/groups.py, docs/design.md §1): its semantics, and that the
runtime never looks up the Megatron sub-package (issue 17 item 5)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch.distributed as dist

from megatron_hsap.errors import ConfigError
from megatron_hsap.runtime import groups as G

RUNTIME = Path(G.__file__).resolve().parent
UPWARD = "megatron_hsap.megatron"


def upward_lookups(source: str) -> list[str]:
    """Imports of, and dotted-module-path strings naming, ``megatron_hsap.megatron`` (what an
    ``import`` or a ``sys.modules`` / ``importlib`` lookup needs). Prose in messages is allowed."""
    found = []
    for node in ast.walk(ast.parse(source)):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            if node.value == UPWARD or (node.value.startswith(UPWARD + ".") and " " not in node.value
                                        and node.value.replace(".", "").replace("_", "").isalnum()):
                names = [node.value]
        found += [n for n in names if n == UPWARD or n.startswith(UPWARD + ".")]
    return found


def test_scanner_catches_the_old_lookup():
    assert upward_lookups('_P = "megatron_hsap.megatron.parallel_state"\nimport sys\nsys.modules.get(_P)\n')
    assert upward_lookups("from megatron_hsap.megatron.parallel_state import get_hsap_groups\n")
    assert upward_lookups("from megatron_hsap import megatron\n")
    assert upward_lookups("import megatron_hsap.megatron\n")
    assert not upward_lookups('raise X("call megatron_hsap.megatron.initialize_hsap(2, 4) first")\n')


def test_runtime_never_looks_up_the_megatron_subpackage():
    files = sorted(RUNTIME.glob("*.py"))
    assert len(files) > 10 and (RUNTIME / "hsap.py") in files
    bad = {f.name: hits for f in files if (hits := upward_lookups(f.read_text()))}
    assert bad == {}


class _FakeGroup:  # HSAPGroups does not inspect the process groups it holds
    pass


def _groups(topology=(2, 2), cp_rank=3) -> G.HSAPGroups:
    intra, inter = topology
    return G.HSAPGroups(intra=_FakeGroup(), inter=_FakeGroup(), intra_size=intra, inter_size=inter,  # type: ignore[arg-type]
                        cp_rank=cp_rank, intra_rank=cp_rank % intra, inter_rank=cp_rank // intra)


@pytest.fixture
def empty_registry():
    assert G.registered_groups() is None, "another test left HSAP groups registered"
    yield
    G.clear_groups()


def test_register_get_clear(empty_registry):
    groups, owned = _groups(), (_FakeGroup(), _FakeGroup())
    G.register_groups(groups, owned=owned)
    assert G.registered_groups() is groups
    with pytest.raises(ConfigError, match=r"already initialised \(2x2\); call destroy_hsap\(\) first"):
        G.register_groups(_groups((4, 1), 1))
    assert G.registered_groups() is groups  # the refused registration changed nothing
    assert G.clear_groups() == owned
    assert G.registered_groups() is None
    assert G.clear_groups() == ()  # idempotent
    with pytest.raises(ConfigError, match="takes an HSAPGroups, got tuple"):
        G.register_groups((1, 2))  # type: ignore[arg-type]
    assert G.registered_groups() is None


def test_megatron_names_read_the_registry(empty_registry):
    """get_hsap_groups / is_hsap_initialized / destroy_hsap are views of the runtime's registry."""
    from megatron_hsap.megatron import parallel_state as ps

    assert not ps.is_hsap_initialized()
    with pytest.raises(ConfigError, match="HSAP groups are not initialised"):
        ps.get_hsap_groups()
    groups = _groups()
    G.register_groups(groups)  # hand-built groups count as initialised
    assert ps.is_hsap_initialized() and ps.get_hsap_groups() is groups
    if not dist.is_initialized():
        with pytest.raises(ConfigError, match=r"already initialised \(2x2\)"):  # before the dist check
            ps.initialize_hsap(2, 2)
    ps.destroy_hsap()
    assert G.registered_groups() is None and not ps.is_hsap_initialized()
    ps.destroy_hsap()  # idempotent


def test_runtime_resolves_registered_groups(empty_registry, monkeypatch):
    """hsap's group resolution reads the registry, and checks the plan against it."""
    from megatron_hsap.plan import compile_plan
    from megatron_hsap.runtime import hsap

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    plan = compile_plan([0, 64], 2, intra_size=2, num_heads=4, head_dim=8, flatten="never")  # the 2x2 topology
    groups = _groups()
    G.register_groups(groups)
    assert hsap._resolve_groups(plan, None, None) == (groups.intra, groups.inter)
    G.clear_groups()
    G.register_groups(_groups((4, 1), 1))
    with pytest.raises(ConfigError, match="the plan is 2x2 .* but the HSAP groups are 4x1"):
        hsap._resolve_groups(plan, None, None)
    G.clear_groups()
    with pytest.raises(ConfigError, match="needs intra_group= and inter_group="):
        hsap._resolve_groups(plan, None, None)
