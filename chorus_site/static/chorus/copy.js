// "Copy" buttons (the take-over command): a static file, not an inline script, so the admin runs
// under a Content-Security-Policy without 'unsafe-inline'.
document.querySelectorAll(".chorus-copy").forEach(function (b) {
  b.addEventListener("click", function () {
    var text = document.getElementById(b.dataset.copy).textContent;
    if (navigator.clipboard) navigator.clipboard.writeText(text);
    b.textContent = "Copied";
  });
});
