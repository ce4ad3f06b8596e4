"""tokenmill plugin ``example-policies``: registers three implementations and declares typed options.

- scheduler ``shortest-first``: runs the shortest prompts first (``scheduler.policy``);
- logits processor ``banned-words``: token ids no request may generate (``sampler.logits_processors``);
- router ``least-in-flight``: sends each request to the engine with the fewest in flight (``server.router``).

Only registration lives here: each class's module is imported when a config selects it, so
``tokenmill plugins`` stays fast and the API front end (which builds the router) never imports torch.
"""

from __future__ import annotations

from tokenmill import hookimpl
from tokenmill.hookspecs import Register
from tokenmill_example_policies.options import ExamplePoliciesOptions


@hookimpl
def tokenmill_plugin_options() -> type[ExamplePoliciesOptions]:
    return ExamplePoliciesOptions


@hookimpl
def tokenmill_register_schedulers(register: Register) -> None:
    register("shortest-first", "tokenmill_example_policies.scheduler:ShortestFirstScheduler")


@hookimpl
def tokenmill_register_logits_processors(register: Register) -> None:
    register("banned-words", "tokenmill_example_policies.banned_words:BannedWordsLogitsProcessor")


@hookimpl
def tokenmill_register_routers(register: Register) -> None:
    register("least-in-flight", "tokenmill_example_policies.router:LeastInFlightRouter")
