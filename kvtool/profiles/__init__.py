"""Profiles: the per-layer KV budget format (schema), its YAML file form (io, validate), model
fingerprints, and the pure budget mathematics (lorenz, allocation, budget; numpy only, no torch)."""

from kvtool.profiles.document import profile_to_dict
from kvtool.profiles.fingerprint import fingerprint_of
from kvtool.profiles.io import read_profile, save_profile
from kvtool.profiles.schema import (
    MERGE_MODES,
    SELECTION_RULES,
    SCHEMA_VERSION,
    CalibrationInfo,
    Draft,
    RecipeTrial,
    LayerProfile,
    MethodSettings,
    ModelFingerprint,
    Profile,
    PromptStats,
)
from kvtool.profiles.validate import validate_profile

__all__ = [
    "MERGE_MODES",
    "SELECTION_RULES",
    "SCHEMA_VERSION",
    "CalibrationInfo",
    "Draft",
    "RecipeTrial",
    "LayerProfile",
    "MethodSettings",
    "ModelFingerprint",
    "Profile",
    "PromptStats",
    "fingerprint_of",
    "profile_to_dict",
    "read_profile",
    "save_profile",
    "validate_profile",
]
