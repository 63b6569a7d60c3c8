"""A batch cut short by a run's stop raises what Spark reads as a stop, short enough for the
regex Spark reads it with, and py4j does not log it; any other error goes up as it was.
(No JVM: its exceptions are stood in for by objects that answer what the runner asks.)
tests/projections/test_stop.py stops real runs."""

from __future__ import annotations

import logging
import re
import signal
import traceback
from dataclasses import dataclass

import pytest

pytest.importorskip("pyspark")

from py4j.protocol import Py4JJavaError
from pyspark.errors.exceptions.captured import CapturedException

from esk.projections.runner import _PY4J_FILTER, BatchInterrupted, StopRequest, _interruptible, stop_on_signals

# Spark's StreamExecution.PROXY_ERROR, which tells a stop's interruption from a failure
SPARK_PROXY_ERROR = re.compile(
    r"py4j\.protocol\.Py4JJavaError: An error occurred while calling"
    r"(.|\r\n|\r|\n)*(java\.lang\.InterruptedException|java\.io\.InterruptedIOException|java\.nio\.channels\.ClosedByInterruptException)"
)


@dataclass
class JavaClass:
    name: str

    def getName(self) -> str:
        return self.name


@dataclass
class JavaException:
    name: str
    message: str = ""
    cause: JavaException | None = None
    _target_id: str = "o1"  # what Py4JJavaError reads off a Java object

    def getClass(self) -> JavaClass:
        return JavaClass(self.name)

    def getMessage(self) -> str:
        return self.message

    def getCause(self) -> JavaException | None:
        return self.cause


INTERRUPTED = JavaException("java.lang.InterruptedException")
CANCELLED = JavaException("org.apache.spark.SparkException", "Job 7 cancelled part of cancelled job group 3f2a")
FAILED = JavaException("org.apache.spark.SparkException", "Job aborted due to stage failure")


def failing(java_exception: JavaException, as_pyspark: bool = False) -> object:
    def batch(_records: object, _batch_id: int) -> None:
        if as_pyspark:  # as PySpark raises some of the JVM's errors (needs a JVM to be made)
            error = CapturedException.__new__(CapturedException)
            error._origin = java_exception
            raise error
        raise Py4JJavaError("An error occurred while calling o359.collectToPython.\n", java_exception)

    return batch


def asked() -> StopRequest:
    stop = StopRequest()
    stop.asked.set()
    return stop


@pytest.mark.parametrize(
    ("java_exception", "as_pyspark"),
    [
        (INTERRUPTED, False),
        (CANCELLED, False),
        (JavaException("org.apache.spark.SparkException", "Exception thrown in awaitResult", INTERRUPTED), False),
        (JavaException("org.apache.spark.SparkRuntimeException", "a task failed", INTERRUPTED), True),
    ],
    ids=["interrupted", "job cancelled", "interruption as the cause", "as PySpark's own exception"],
)
def test_a_batch_interrupted_by_the_stop_raises_what_spark_reads_as_a_stop(java_exception: JavaException, as_pyspark: bool) -> None:
    try:
        _interruptible(failing(java_exception, as_pyspark), asked().asked.is_set)(None, 3)  # type: ignore[arg-type]
    except BatchInterrupted:
        sent_to_the_jvm = traceback.format_exc()  # what py4j answers the JVM with
    else:
        pytest.fail("the batch's error went up as it was")
    assert SPARK_PROXY_ERROR.search(sent_to_the_jvm)
    # the Python error the JVM raised, whose text carries the Java stack, is not in it
    assert "During handling" not in sent_to_the_jvm and "collectToPython" not in sent_to_the_jvm
    assert len(sent_to_the_jvm) < 1_000


@pytest.mark.parametrize(
    ("java_exception", "stop"),
    [(FAILED, asked()), (INTERRUPTED, StopRequest())],
    ids=["a failure during a stop", "an interruption no stop asked for"],
)
def test_any_other_error_goes_up_as_it_was(java_exception: JavaException, stop: StopRequest) -> None:
    with pytest.raises(Py4JJavaError) as raised:
        _interruptible(failing(java_exception), stop.asked.is_set)(None, 3)  # type: ignore[arg-type]
    assert raised.value.java_exception is java_exception


def test_py4j_does_not_log_a_batch_interrupted_by_the_stop() -> None:
    def record(error: Exception) -> logging.LogRecord:
        return logging.LogRecord("py4j.clientserver", logging.ERROR, __file__, 1, "There was an exception", None, (type(error), error, None))

    _interruptible(lambda _records, _batch_id: None, StopRequest().asked.is_set)
    assert _PY4J_FILTER in logging.getLogger("py4j.clientserver").filters
    assert not _PY4J_FILTER.filter(record(BatchInterrupted("stopped")))
    assert _PY4J_FILTER.filter(record(ValueError("a read model's bug")))


def test_the_other_signal_after_the_first_is_the_same_stop_and_the_same_again_stops_at_once() -> None:
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        stop = stop_on_signals()
        handler = signal.getsignal(signal.SIGINT)
        assert callable(handler) and handler is signal.getsignal(signal.SIGTERM)
        handler(signal.SIGINT, None)  # Ctrl-C in the terminal
        assert stop.asked.is_set() and not stop.now.is_set()
        handler(signal.SIGTERM, None)  # then esk dev's SIGTERM: the same stop
        assert not stop.now.is_set()
        handler(signal.SIGINT, None)  # Ctrl-C again
        assert stop.now.is_set()
    finally:
        for s, h in before.items():
            signal.signal(s, h)
