"""The Registry: registration, resolving a reference to a definition, and worker selection."""

from __future__ import annotations

import pytest

from umt_sdk import Registry, TaskContext, TaskDefinition, TaskPair, task
from umt_sdk.exceptions import TaskDefinitionError, UmtError, UnknownTaskError


@task("report", version=1)
async def report_v1(ctx: TaskContext[str]) -> str:
    return ctx.input


@task("report", version=2)
async def report_v2(ctx: TaskContext[str]) -> int:
    return len(ctx.input)


@task("report", version=10)
async def report_v10(ctx: TaskContext[str]) -> int:
    return 10


@task("cleanup", version=1)
async def cleanup_v1(ctx: TaskContext[int]) -> None:
    del ctx


@pytest.fixture
def registry() -> Registry:
    return Registry([report_v2, cleanup_v1, report_v1, report_v10])


def test_contents_are_listed_in_order(registry: Registry) -> None:
    assert len(registry) == 4
    assert [str(p) for p in registry.pairs()] == ["cleanup@1", "report@1", "report@2", "report@10"]
    assert list(registry) == [cleanup_v1, report_v1, report_v2, report_v10]


def test_adding_the_same_definition_again_is_harmless(registry: Registry) -> None:
    registry.add(report_v1)
    assert len(registry) == 4


def test_two_definitions_of_one_pair_are_refused(registry: Registry) -> None:
    @task("report", version=2)
    async def impostor(ctx: TaskContext[str]) -> int:
        return 0

    with pytest.raises(TaskDefinitionError, match=r"report@2 is registered twice") as caught:
        registry.add(impostor)
    assert "bump the version" in str(caught.value)
    assert registry.get("report", 2) is report_v2, "the first registration stays"
    with pytest.raises(TaskDefinitionError, match="registered twice"):
        Registry([report_v2, impostor])


def test_only_definitions_can_be_registered() -> None:
    async def bare(ctx: TaskContext[str]) -> str:
        return ""

    with pytest.raises(TaskDefinitionError, match="takes @task-decorated definitions"):
        Registry([bare])  # type: ignore[list-item]


def test_get_and_latest(registry: Registry) -> None:
    assert registry.get("report", 1) is report_v1
    assert registry.latest("report") is report_v10, "versions compare as numbers"
    assert registry.latest("cleanup") is cleanup_v1


def test_unknown_tasks_raise_a_lookup_error(registry: Registry) -> None:
    with pytest.raises(UnknownTaskError) as caught:
        registry.get("report", 3)
    error = caught.value
    assert isinstance(error, LookupError)
    assert isinstance(error, TaskDefinitionError)
    assert isinstance(error, UmtError)
    assert error.task_name == "report"
    assert "report@3 is not registered" in str(error)
    assert "report@10" in str(error), "the message lists what is registered"
    with pytest.raises(LookupError, match="no task named 'nope'"):
        registry.latest("nope")
    with pytest.raises(UnknownTaskError, match="registered: none"):
        Registry().latest("anything")


# -- resolve ----------------------------------------------------------------------------------


def test_a_name_resolves_to_the_newest_version(registry: Registry) -> None:
    assert registry.resolve("report") is report_v10
    assert registry.resolve("report", version=2) is report_v2


def test_name_at_version_strings(registry: Registry) -> None:
    assert registry.resolve("report@2") is report_v2
    assert registry.resolve("report@1", version=1) is report_v1
    with pytest.raises(TaskDefinitionError, match=r"'report@1' conflicts with version=2"):
        registry.resolve("report@1", version=2)
    with pytest.raises(UnknownTaskError):
        registry.resolve("report@3")


@pytest.mark.parametrize("ref", ["report@x", "report@", "@2", "re port@2"])
def test_malformed_references_are_definition_errors(registry: Registry, ref: str) -> None:
    with pytest.raises(TaskDefinitionError, match="expected 'task_name@version'"):
        registry.resolve(ref)


def test_the_newest_definition_resolves_to_itself(registry: Registry) -> None:
    assert registry.resolve(report_v10) is report_v10
    assert registry.resolve(cleanup_v1) is cleanup_v1


def test_a_stale_definition_is_refused_unless_pinned(registry: Registry) -> None:
    with pytest.raises(TaskDefinitionError, match="not the newest registered version") as caught:
        registry.resolve(report_v1)
    assert "report@10" in str(caught.value)
    assert "version=1" in str(caught.value)
    assert registry.resolve(report_v1, version=1) is report_v1
    assert registry.resolve(report_v2, version=2) is report_v2


def test_an_unregistered_definition_is_unknown(registry: Registry) -> None:
    @task("stranger")
    async def stranger(ctx: TaskContext[str]) -> str:
        return ""

    with pytest.raises(UnknownTaskError):
        registry.resolve(stranger)
    with pytest.raises(UnknownTaskError):
        registry.resolve("stranger")


def test_resolve_refuses_other_things(registry: Registry) -> None:
    with pytest.raises(TaskDefinitionError, match="expected a task definition or a task name"):
        registry.resolve(42)  # type: ignore[arg-type]


# -- select -----------------------------------------------------------------------------------


def test_select_none_is_everything(registry: Registry) -> None:
    assert registry.select(None) == registry.pairs()


def test_select_takes_strings_pairs_and_definitions(registry: Registry) -> None:
    selected = registry.select(
        ["report@2", TaskPair(name="cleanup", version=1), report_v1, " report@2 "]
    )
    assert selected == [
        TaskPair(name="cleanup", version=1),
        TaskPair(name="report", version=1),
        TaskPair(name="report", version=2),
    ]


def test_select_checks_every_pair(registry: Registry) -> None:
    with pytest.raises(UnknownTaskError, match="report@3 is not registered"):
        registry.select(["report@1", "report@3"])
    with pytest.raises(UnknownTaskError):
        registry.select([TaskPair(name="ghost", version=1)])


def test_select_refuses_a_bare_string(registry: Registry) -> None:
    with pytest.raises(TaskDefinitionError, match=r"must be a list such as \['report@1'\]"):
        registry.select("report@1")


def test_select_refuses_an_empty_list(registry: Registry) -> None:
    with pytest.raises(TaskDefinitionError, match="at least one task@version"):
        registry.select([])


def test_select_needs_versions(registry: Registry) -> None:
    with pytest.raises(TaskDefinitionError, match="expected 'task_name@version'"):
        registry.select(["report"])


def test_task_pair_parse_and_str() -> None:
    pair = TaskPair.parse("a.b:c-d/e_f@12")
    assert pair == TaskPair(name="a.b:c-d/e_f", version=12)
    assert str(pair) == "a.b:c-d/e_f@12"
    assert TaskPair(name="a", version=2) < TaskPair(name="a", version=10)
    with pytest.raises(ValueError, match="expected 'task_name@version'"):
        TaskPair.parse("a@b@1")


def test_definitions_are_compared_by_identity() -> None:
    assert isinstance(report_v1, TaskDefinition)
    assert report_v1 != report_v2
    assert len({report_v1, report_v1, report_v2}) == 2
