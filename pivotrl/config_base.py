"""The base of every config section (its own module so that section modules and `pivotrl.config` share it
without importing each other), and the path-bearing field types."""

from __future__ import annotations

import types
import typing
from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, ConfigDict, model_validator

from pivotrl.names import check_name, check_storage_root


def _wants_number(annotation: Any) -> bool:
    if annotation in (int, float):
        return True
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return any(_wants_number(a) for a in typing.get_args(annotation))
    return False


class Section(BaseModel):
    """Base of every config section: unknown keys are errors, assignments are validated, a boolean is
    never taken for a number (`true` would otherwise be 1) and numbers must be finite."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _no_bool_for_number(cls, data: Any) -> Any:
        """A model validator, not a per-field one: pydantic allows no before-validator on a discriminator
        field. The `[field]` prefix lets `pivotrl.config` name the field in its one-line error."""
        if isinstance(data, dict):
            for name, field in cls.model_fields.items():
                value = data.get(name)
                if isinstance(value, bool) and _wants_number(field.annotation):
                    raise ValueError(f"[{name}] a number is wanted, not the boolean {value}")
        return data


# A user name that becomes a path component (run directory, store model directory): see `pivotrl.names`.
SafeName = Annotated[str, AfterValidator(check_name)]
StorageRoot = Annotated[str, AfterValidator(check_storage_root)]
