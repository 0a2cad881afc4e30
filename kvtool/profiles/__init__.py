"""Profiles: the per-layer KV budget format (schema), its YAML file form (io), model fingerprints."""

from kvtool.profiles.fingerprint import fingerprint_of
from kvtool.profiles.io import profile_to_dict, read_profile, save_profile, validate_profile
from kvtool.profiles.schema import (
    CURVE_IMPORTANCE,
    EVICTION_RULES,
    MERGE_MODES,
    SELECTION_RULES,
    SCHEMA_VERSION,
    CalibrationInfo,
    LayerProfile,
    MethodSettings,
    ModelFingerprint,
    Profile,
    PromptStats,
)

__all__ = [
    "CURVE_IMPORTANCE",
    "EVICTION_RULES",
    "MERGE_MODES",
    "SELECTION_RULES",
    "SCHEMA_VERSION",
    "CalibrationInfo",
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
