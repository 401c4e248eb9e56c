"""models/convert/output.py: the config written for each published variant."""

from models.convert import matrix_game, output


def test_published_action_space_table() -> None:
    conv = output._matrix_game({}, "templerun", matrix_game.PUBLISHED["templerun"])
    assert [k for k, _ in conv.action_space["keyboard"]][:3] == ["nomove", "jump", "slide"]
    assert conv.action_space["mouse"] is None and conv.inference["denoising_step_list"] == [
        1000,
        750,
        500,
        250,
    ]
    gta = output._matrix_game({}, "gta_drive", matrix_game.PUBLISHED["gta_drive"])
    assert gta.inference["local_attn_size"] == 4 and gta.inference["warped_timesteps"][1] == 908.8427
    assert output.worldserve_json(gta)["requires"] == []  # served: the action module and I2V run
    assert gta.inference["cond_frames"] == matrix_game.COND_FRAMES
