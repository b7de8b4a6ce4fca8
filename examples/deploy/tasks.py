"""The tasks the deployment examples serve: `umt worker tasks:registry`."""

from __future__ import annotations

from umt_sdk import Registry, TaskContext, task


@task("deploy.greet", version=1)
async def greet(ctx: TaskContext[str]) -> str:
    return await ctx.step.run("greet", lambda: f"hello, {ctx.input}")


registry = Registry([greet])
