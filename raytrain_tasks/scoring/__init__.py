"""Batch scoring with a registered model: its settings (``config``), which input columns feed the model and what
the output holds (``columns``, pure), and the actor that predicts on Ray (``predictor``). The driver's side (resolve
the alias once, check the input, stage and commit the output, record it in MLflow) is raytrain_driver.scoring."""
