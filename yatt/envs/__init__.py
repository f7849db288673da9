"""Environment packages: RL environments from other libraries, played in-process by yatt's agent loops.

Read in this order: `verifiers_env.py` (a `verifiers` environment and its taskset, built once per process from a
row's metadata; offline nltk), `episode.py` (one episode of the environment's own protocol, `Env.run`, driven
turn by turn by a callable that plays the model), and `nltk_data.py` (the offline nltk_data folder textarena
needs, built from PyPI packages). The data source is `yatt.data.sources` (kind verifiers), the loop
`yatt.agents.environment` (rollout.agent.kind: verifiers). docs/environments.md says what runs offline.
"""

INSTALL = "pip install 'yatt[verifiers]'"


def require_verifiers():
    """`verifiers.v1`, or ImportError in one line naming the pip install to run."""
    try:
        import verifiers.v1 as vf
    except ImportError as err:
        raise ImportError(f"environment packages need the verifiers package ({err}): {INSTALL}") from None
    return vf
