import pytest
from pydantic import ValidationError

from domain.accounts import Account, Close, Closed, Deposit, Deposited, Open, Opened, Withdraw, Withdrawn, accounts
from esk import given

OPENED = Opened(owner="ada")


def test_open_a_new_account() -> None:
    state = given(accounts).when(Open(owner="ada")).then(Opened(owner="ada"))
    assert state == Account(owner="ada", movements=0, balance=0, status="open")


def test_open_twice_is_already_exists() -> None:
    given(accounts, OPENED).when(Open(owner="bob")).then_rejected("already_exists")


def test_any_other_command_on_a_missing_account_is_not_found() -> None:
    given(accounts).when(Deposit(amount=1)).then_rejected("not_found")


def test_deposit_and_withdraw_move_the_balance() -> None:
    state = given(accounts, OPENED, Deposited(amount=100)).when(Withdraw(amount=30)).then(Withdrawn(amount=30))
    assert state.balance == 70


def test_withdrawing_more_than_the_balance_is_rejected() -> None:
    rejection = given(accounts, OPENED, Deposited(amount=10)).when(Withdraw(amount=11)).then_rejected(
        "insufficient_funds"
    )
    assert "10" in rejection.detail


def test_withdrawing_the_whole_balance_is_allowed() -> None:
    given(accounts, OPENED, Deposited(amount=10)).when(Withdraw(amount=10)).then(Withdrawn(amount=10))


def test_close_needs_a_zero_balance() -> None:
    given(accounts, OPENED, Deposited(amount=1)).when(Close()).then_rejected("balance_not_zero")
    state = given(accounts, OPENED).when(Close()).then(Closed())
    assert state.status == "closed"


@pytest.mark.parametrize("command", [Deposit(amount=1), Withdraw(amount=1), Close()])
def test_every_command_after_close_is_rejected(command: object) -> None:
    given(accounts, OPENED, Closed()).when(command).then_rejected("account_closed")  # type: ignore[arg-type]


@pytest.mark.parametrize("payload", [{"amount": 0}, {"amount": -5}, {"amount": "x"}, {}, {"amount": 1, "extra": 1}])
def test_bad_amounts_and_unknown_fields_are_invalid(payload: dict[str, object]) -> None:
    with pytest.raises(ValidationError):
        accounts.parse_command("deposit", payload)


def test_unknown_command_name() -> None:
    with pytest.raises(KeyError):
        accounts.parse_command("transfer", {})


def test_opened_v1_is_upcast_to_v2() -> None:
    event = accounts.decode_event("Opened", 1, {"name": "ada"})
    assert event == Opened(owner="ada")
    assert accounts.decode_event("Opened", 2, {"owner": "ada"}) == event


def test_state_is_the_fold_of_the_events() -> None:
    events = [OPENED, Deposited(amount=5), Deposited(amount=7), Withdrawn(amount=2)]
    assert accounts.fold(events) == Account(owner="ada", movements=3, balance=10)


def test_a_closed_account_expires_after_its_retention() -> None:
    at = 1_767_225_600_000  # 2026-01-01, epoch milliseconds
    assert accounts.expires_at(Account(owner="a", movements=0), at) is None
    assert accounts.expires_at(Account(owner="a", movements=0, status="closed"), at) == at + 30 * 24 * 3600 * 1000
