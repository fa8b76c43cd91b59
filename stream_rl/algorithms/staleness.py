"""Policy lag of each sequence, computed from the data, and the ``max_lag`` filter.

Consumes: ``token_versions`` ``[B, T]``, the policy version that generated each token (a sequence can span several
versions when weights are updated mid-generation), the response mask and the trainer's ``current_version``.
Produces: the lag of each sequence ``[B]`` (int64) and a keep mask ``[B]`` (bool).
Guarantees: a sequence's lag is set by its OLDEST valid token, so one stale token is enough to make it stale;
padding never counts; a sequence without valid tokens has lag 0.

Formula: lag_b = current_version - min_{t valid} token_versions[b, t]; keep_b = lag_b <= max_lag.
Reference: the staleness bound of asynchronous RL systems: prime-rl's ``max_off_policy_steps`` (8), AReaL's eta,
SkyRL and TRL async (4). Use the keep mask to drop sequences (``mask & keep[:, None]``) before the loss; the
aggregation modes leave fully-masked sequences out of their denominators.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ._checks import as_bool_mask, check_tensor


def policy_lag(token_versions: Tensor, mask: Tensor, current_version: int) -> Tensor:
    """Lag of each sequence: ``current_version`` minus the oldest version among its valid tokens; returns ``[B]``.

    Formula: lag_b = current_version - min_{t : mask[b, t]} token_versions[b, t], 0 for a row without valid tokens.
    Reference: AReaL (Fu et al. 2025) stamps versions per token; prime-rl per episode span. Raises ValueError when a
    valid token is newer than ``current_version`` (the trainer cannot have data from a policy it has not made yet).
    """
    token_versions = check_tensor(token_versions, "token_versions", ndim=2)
    if token_versions.dtype.is_floating_point or token_versions.dtype == torch.bool or token_versions.is_complex():
        raise ValueError(f"token_versions must be an integer tensor, got dtype {token_versions.dtype}")
    m = as_bool_mask(mask, token_versions, "token_versions")
    current = int(current_version)
    if current != current_version or current < 0:
        raise ValueError(f"current_version must be an integer >= 0, got {current_version!r}")
    versions = token_versions.to(torch.int64)  # [B, T]
    if bool((versions > current).logical_and(m).any()):
        raise ValueError(f"token_versions holds versions newer than current_version={current}")
    if versions.shape[-1] == 0:  # no tokens at all
        return torch.zeros(versions.shape[0], dtype=torch.int64, device=versions.device)  # [B]
    oldest = torch.where(m, versions, torch.full_like(versions, current)).amin(-1)  # [B]; padding reads as current
    return current - oldest  # [B]


def max_lag_filter(token_versions: Tensor, mask: Tensor, current_version: int, max_lag: int) -> Tensor:
    """Keep mask ``[B]`` (bool): True for sequences whose :func:`policy_lag` is at most ``max_lag``.

    Formula: keep_b = (current_version - min_{t valid} token_versions[b, t]) <= max_lag. ``max_lag`` >= 0 (0 keeps
    only fully on-policy sequences). Reference: prime-rl's ``max_off_policy_steps`` filter.
    """
    if isinstance(max_lag, bool) or int(max_lag) != max_lag or max_lag < 0:
        raise ValueError(f"max_lag must be an integer >= 0, got {max_lag!r}")
    return policy_lag(token_versions, mask, current_version) <= int(max_lag)  # [B]
