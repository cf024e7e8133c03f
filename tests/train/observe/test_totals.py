"""The whole run's loss across resumes (`lowmem_ft.train.observe.totals`); the end-to-end check is in test_interrupt.py."""

from lowmem_ft.train.observe.totals import Totals, logged_totals


def test_logged_losses_count_each_step_of_their_span_once():
    history = [{"loss": 3.0, "step": 2}, {"eval_loss": 9.0, "step": 2}, {"loss": 1.0, "step": 5}, {"loss": 7.0}]
    totals = logged_totals(history)
    assert (totals.steps, totals.loss_sum) == (5, 3.0 * 2 + 1.0 * 3)
    assert totals.mean_loss == 9.0 / 5


def test_totals_add_up_and_an_empty_run_has_no_mean():
    assert Totals(2, 4.0, 1.5) + Totals(3, 3.0, 2.0) == Totals(5, 7.0, 3.5)
    assert Totals().mean_loss is None
