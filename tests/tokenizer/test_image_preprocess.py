"""Image loading and Chameleon's preprocessing: alpha on white, EXIF, odd modes, and clear errors for bad files."""

import io
import struct
import zlib

import numpy as np
import pytest
import torch
from PIL import Image

from tokenizer.image.preprocess import ImageLoadError, load_batch, open_image, preprocess, to_pil


def _png_bytes(img: Image.Image) -> bytes:
    buffer = io.BytesIO()
    img.save(buffer, "PNG")
    return buffer.getvalue()


def _chunk(kind: bytes, data: bytes) -> bytes:
    return (
        struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)
    )


def _png_header_only(width: int, height: int) -> bytes:
    """A valid PNG signature + IHDR claiming a huge size (no pixel data needed to test the size policy)."""
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + _chunk(b"IHDR", ihdr)
        + _chunk(b"IDAT", zlib.compress(b"\x00"))
        + _chunk(b"IEND", b"")
    )


def test_preprocess_resizes_shortest_side_with_lanczos_then_center_crops_to_minus_one_one():
    rng = np.random.default_rng(0)
    img = Image.fromarray(rng.integers(0, 256, (30, 50, 3), dtype=np.uint8), "RGB")
    out = preprocess(img, 16)
    # Chameleon's steps written out: scale = 16/30 -> (27, 16), LANCZOS, crop x0 = (27-16)//2 = 5
    expected = (
        np.asarray(img.resize((27, 16), Image.LANCZOS).crop((5, 0, 21, 16)), dtype=np.float64) / 255 * 2 - 1
    )
    assert out.shape == (3, 16, 16) and out.dtype == torch.float32
    torch.testing.assert_close(out, torch.from_numpy(expected).permute(2, 0, 1).float())


def test_transparent_pixels_become_white_and_partial_alpha_blends_like_chameleon():
    rgba = np.zeros((16, 16, 4), dtype=np.uint8)
    rgba[..., 0] = 200  # red channel
    rgba[:8, :, 3] = 0  # top half fully transparent
    rgba[8:, :, 3] = 128  # bottom half half-transparent
    img = open_image(Image.fromarray(rgba, "RGBA"))
    pixels = np.asarray(img)
    assert img.mode == "RGB"
    assert (pixels[:8] == 255).all()
    a = 128 / 255.0
    assert pixels[8, 0, 0] == int((1 - a) * 255 + a * 200) and pixels[8, 0, 1] == int((1 - a) * 255)


def test_palette_with_transparency_la_grayscale_and_cmyk_become_rgb(tmp_path):
    palette = Image.new("P", (16, 16), 1)
    palette.putpalette([0, 0, 0, 255, 0, 0] + [0] * 762)
    palette.info["transparency"] = 1  # index 1 (red) is transparent -> white
    path = tmp_path / "palette.png"
    palette.save(path, transparency=1)
    assert (np.asarray(open_image(path)) == 255).all()

    la = Image.fromarray(
        np.stack([np.full((16, 16), 10, np.uint8), np.full((16, 16), 255, np.uint8)], -1), "LA"
    )
    assert (np.asarray(open_image(la)) == 10).all()

    gray = open_image(Image.fromarray(np.full((16, 16), 77, np.uint8), "L"))
    assert gray.mode == "RGB" and (np.asarray(gray) == 77).all()

    cmyk_path = tmp_path / "cmyk.jpg"
    Image.new("CMYK", (16, 16), (0, 255, 255, 0)).save(cmyk_path, quality=95)  # pure red in CMYK
    red = np.asarray(open_image(cmyk_path)).astype(int)
    assert red[..., 0].mean() > 200 and red[..., 1].mean() < 60


def test_sixteen_bit_grayscale_is_scaled_not_clipped(tmp_path):
    values = np.full((16, 16), 32768, dtype=np.uint16)  # mid-grey in 16 bits
    path = tmp_path / "deep.png"
    Image.fromarray(values).save(path)
    pixels = np.asarray(open_image(path))
    assert abs(int(pixels[0, 0, 0]) - 128) <= 1  # PIL's own convert would clip this to 255


def test_exif_orientation_is_applied(tmp_path):
    img = Image.new("RGB", (40, 20), (0, 0, 255))
    exif = img.getexif()
    exif[0x0112] = 6  # "rotate 90 CW to display"
    path = tmp_path / "rotated.jpg"
    img.save(path, exif=exif)
    assert open_image(path).size == (20, 40)


def test_animated_gif_gives_its_first_frame(tmp_path):
    frames = [Image.new("RGB", (16, 16), (255, 0, 0)), Image.new("RGB", (16, 16), (0, 0, 255))]
    path = tmp_path / "anim.gif"
    frames[0].save(path, save_all=True, append_images=frames[1:], duration=50, loop=0)
    pixels = np.asarray(open_image(path)).astype(int)
    assert pixels[..., 0].mean() > 200 and pixels[..., 2].mean() < 50


@pytest.mark.parametrize(
    "make, needle",
    [
        (lambda p: p.write_bytes(_png_bytes(Image.new("RGB", (32, 32)))[:60]), "truncated or corrupt"),
        (lambda p: p.write_text("not an image at all"), "not an image"),
        (lambda p: p.write_bytes(_png_bytes(Image.new("RGB", (1, 1)))), "too small"),
        (lambda p: p.write_bytes(_png_header_only(20_000, 20_000)), "decompression bomb"),
        (lambda p: p.write_bytes(_png_header_only(20_000, 100)), "aspect ratio"),
    ],
    ids=["truncated", "non-image", "1x1", "20000x20000", "20000x100"],
)
def test_bad_files_raise_image_load_error_naming_the_file(tmp_path, make, needle):
    path = tmp_path / "bad.png"
    make(path)
    with pytest.raises(ImageLoadError, match=needle) as info:
        preprocess(path, 16)
    assert str(path) in str(info.value)
    assert isinstance(info.value, ValueError)


def test_wide_panorama_within_limits_is_accepted_and_center_cropped():
    panorama = Image.new("L", (20_000, 1_000), 0)
    panorama.paste(255, (9_500, 0, 10_500, 1_000))  # a bright band in the middle survives the center crop
    out = preprocess(panorama, 16)
    assert out.shape == (3, 16, 16) and out[:, :, 8].min() > 0.9


def test_missing_file_and_bytes_name_the_source(tmp_path):
    with pytest.raises(ImageLoadError, match="no such file"):
        open_image(tmp_path / "missing.png")
    with pytest.raises(ImageLoadError, match="shard-7:doc.png"):
        open_image(b"garbage", name="shard-7:doc.png")


def test_load_batch_skips_and_counts_bad_images_only_when_asked(tmp_path):
    good = _png_bytes(Image.new("RGB", (20, 20), (9, 9, 9)))
    bad = tmp_path / "broken.png"
    bad.write_bytes(good[:50])
    batch = load_batch([good, bad, good], 8, skip_errors=True)
    assert batch.pixels.shape == (2, 3, 8, 8) and batch.indices == [0, 2]
    assert [name for name, _ in batch.skipped] == [str(bad)]
    with pytest.raises(ImageLoadError, match="broken.png"):
        load_batch([good, bad], 8)


def test_to_pil_inverts_preprocess_exactly():
    rng = np.random.default_rng(1)
    array = rng.integers(0, 256, (16, 16, 3), dtype=np.uint8)
    back = to_pil(preprocess(Image.fromarray(array, "RGB"), 16))
    assert np.array_equal(np.asarray(back), array)
    assert len(to_pil(torch.zeros(2, 3, 4, 4))) == 2
