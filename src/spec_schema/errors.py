"""The one error type of the contract."""

from typing import Optional


class SpecContractError(TypeError):
    """A phase object broke the contract.

    The message names the phase class and field, the producer and consumer when known, the axis,
    the expected value with its origin, and the actual shape and dtype. The attributes carry the same
    facts for programs.
    """

    def __init__(
        self,
        message: str,
        *,
        cls_name: str = "",
        field: Optional[str] = None,
        axis: Optional[str] = None,
        producer: Optional[str] = None,
        consumer: Optional[str] = None,
    ) -> None:
        super().__init__(message)
        self.cls_name = cls_name
        self.field = field
        self.axis = axis
        self.producer = producer
        self.consumer = consumer
